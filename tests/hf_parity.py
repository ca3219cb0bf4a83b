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


def check_task_eval(path, hf, tmp_path, seq_len=40, rel=1e-5):
    """task=eval of the checkpoint at ``path`` (model.path's route, which reads it whole) on the byte corpus's
    slices of ``seq_len``: its perplexity within ``rel`` of transformers' ``hf`` on the same slices; the
    checkpoint's ModelConfig, for the caller's own checks of what was read."""
    from conftest import TEXT, eval_job, transformers_perplexity

    from kvbench.config.model import AttentionConfig, ModelConfig
    from kvbench.quality.train import run_eval

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    model = ModelConfig(path=str(path))
    cfg = eval_job(model, AttentionConfig(), corpus, path, val_fraction=0.25, seq_len=seq_len, batch_size=2)
    assert run_eval(cfg, torch.device("cpu"))["perplexity"] == pytest.approx(transformers_perplexity(hf, cfg), rel=rel)
    return model
