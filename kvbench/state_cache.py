"""The cache of a recurrent layer (:class:`~kvbench.layouts.base.State`): per sequence the last
inputs of its short convolution and one recurrent state, whatever the sequence's length.

    update(x, pos) -> Carry(inputs, state)

``x`` (B, C, T): the new convolution inputs. ``inputs`` (B, C, K - 1 + T): what the causal
convolution reads, the held tail first (as a ring K/V cache returns held keys before new ones);
``state`` (B, ...): the recurrent state before these tokens, which the layer advances in place.
A write at position 0 starts a sequence from zeros. Unlike K/V, a state folds every position into
one tensor, so it cannot roll back.

Notation: B batch, T new tokens, C convolution channels, K its taps.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

# a state's dtype as the layouts name it (cache.state_dtype): they import no torch
STATE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Carry(NamedTuple):
    """What a recurrent layer continues from (see the module's docstring)."""

    inputs: torch.Tensor
    state: torch.Tensor


class StateLayer:
    """One recurrent layer's cache: a (B, C, K - 1) convolution tail in the compute dtype and the
    state in the layout's ``state_dtype``, written in place; ``held`` False (cache ``none``): every
    forward starts from zeros. The kernels read the state up-cast to float32 and write it back
    down-cast (``copy_``), as transformers and the state-space kernels do, so a half-precision state
    rounds once per forward, not once per operation. ``nbytes``: what it holds, B x ``State.nbytes``."""

    def __init__(self, state, batch_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 held: bool = True):
        self.shape, self.held = state, held
        self.state_dtype = STATE_DTYPES[state.state_dtype]
        self.conv = torch.zeros(batch_size if held else 0, state.conv_channels, state.conv_tail, dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros((batch_size if held else 0,) + state.recurrent, dtype=self.state_dtype,
                                     device=device)

    def update(self, x: torch.Tensor, pos) -> Carry:
        B, tail = x.shape[0], self.shape.conv_tail
        if not self.held:
            return Carry(torch.cat([x.new_zeros(B, x.shape[1], tail), x], -1),
                         torch.zeros((B,) + self.shape.recurrent, dtype=self.state_dtype, device=x.device))
        conv, state = self.conv[:B], self.recurrent[:B]
        if pos.start == 0:  # a new sequence
            conv.zero_()
            state.zero_()
        inputs = torch.cat([conv, x], -1)  # (B, C, K - 1 + T)
        if tail:
            conv.copy_(inputs[..., inputs.shape[-1] - tail:])
        return Carry(inputs, state)

    def tensors(self) -> List[torch.Tensor]:
        return [self.conv, self.recurrent] if self.held else []

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def refusal(self, length: int, held: int) -> Optional[str]:
        """Only to 0 or ``held``: a state folds positions 0..held-1 together."""
        if length not in (0, held):
            return (f"cannot truncate to {length}: a recurrent state folds positions 0..{held - 1} together and "
                    f"cannot roll back; only reset() (0) or {held} works")
        return None

    def truncate(self, length: int, held: int) -> None:
        why = self.refusal(length, held)
        if why:
            raise ValueError(why)
        if length == 0:
            self.conv.zero_()
            self.recurrent.zero_()

    def fixed_view(self, length: int):
        raise ValueError("a recurrent state has no fixed-shape view (the step reads a context bucket of K/V); "
                         "use runtime.compile=false|default")
