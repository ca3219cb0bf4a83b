"""The checks a checkpoint family's parity test makes against transformers' own model of it: the
logits and perplexity of a prompt, then greedy cached steps token-equal to ``generate``."""

import pytest
import torch

from kvbench.cache import cache_for
from kvbench.generate import greedy_generate


def check_logits_and_perplexity(model, hf, tokens, spread=0.5, rel=1e-5):
    """Our logits of ``tokens`` within ``rel`` of transformers' largest (which vary by more than
    ``spread``: a random checkpoint that says something), and the perplexities within ``rel``."""
    ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= rel * theirs.abs().max().item() and theirs.std() > spread
    ce = [torch.nn.functional.cross_entropy(x[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()) for x in (ours, theirs)]
    assert ce[0].exp().item() == pytest.approx(ce[1].exp().item(), rel=rel)


def check_greedy_steps(model, hf, prompt, steps=40):
    """``steps`` greedy cached steps after ``prompt`` (B, P) equal to ``hf.generate``'s tokens, and
    not one token repeated; the tokens (B, steps + 1)."""
    B, P = prompt.shape
    got = greedy_generate(model, prompt, steps, cache_for(model, "static", B, P + steps + 1)).tokens
    want = hf.generate(prompt, max_new_tokens=steps + 1, do_sample=False, min_new_tokens=steps + 1)[:, P:]
    assert torch.equal(got, want)
    assert len(set(got[0].tolist())) > 5  # the steps do not repeat one token
    return got
