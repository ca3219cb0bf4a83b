"""The attention of a latent layer without rotary embeddings
(:class:`kvbench.layouts.latent_nope.LatentNoPE`), as transformers' KimiLinearAttention: DeepSeek's
latent attention (:class:`~kvbench.layouts.latent_attention.LatentAttention`, both decode forms)
with the shared key part and the queries' matching part left as projected."""

from __future__ import annotations

from kvbench.layouts.latent_attention import LatentAttention


class LatentNoPEAttention(LatentAttention):
    """:class:`LatentAttention` that rotates nothing, whatever tables the decoder hands it (a model
    may hold rotary layers beside these): tables of width 0 make ``apply_rope`` the identity."""

    def forward(self, x, cos, sin, cache, pos):
        return super().forward(x, cos[..., :0], sin[..., :0], cache, pos)
