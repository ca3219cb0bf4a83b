"""Is the MQA path right for experiment=recall's model shape? An MQA decoder against the same
weights with its one KV head repeated to 4 (checkpoint.convert_kv_heads 'repeat', exactly the
function MQA computes, but run on the MHA path of SDPA): logits and gradients on a batch of the
preset's MQAR sequences, in training (causal prefill) and through a static cache (decode).

    python experiments/recall_mqa_check.py

Prints the largest differences; the gradient of MQA's K/V weights must equal the sum of the
repeated copies' gradients.
"""

import torch
import torch.nn.functional as F
from _common import say

from kvbench.cache import cache_for
from kvbench.checkpoint import convert_kv_heads
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.model import Decoder
from kvbench.quality.recall import mqar

torch.set_num_threads(1)
torch.manual_seed(0)
shape = ModelConfig(name="recall", num_layers=2, d_model=64, num_heads=4, preset_kv_heads=4, ffn_dim=128,
                    vocab_size=64, max_seq_len=64)
mqa = Decoder(shape, AttentionConfig(type="mqa"))
mha = convert_kv_heads(mqa, 4)  # (B, 4, T, D): each query head's copy of the one KV head
x, y = mqar(torch.Generator().manual_seed(1), 32, 64, 8, 40)
for model in (mqa, mha):
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
say("logits max |diff|:", float((mqa(x) - mha(x)).detach().abs().max()))
worst = 0.0
for (name, p), q in zip(mqa.named_parameters(), mha.parameters()):
    g = q.grad
    if name.endswith(("attn.wk.weight", "attn.wv.weight")):
        g = g.view(4, 16, -1).sum(0)  # the 4 copies' gradients sum to the shared head's
    worst = max(worst, float((p.grad - g).abs().max() / (p.grad.abs().max() + 1e-12)))
say("gradients max relative |diff|:", worst)
with torch.no_grad():
    cache = cache_for(mqa, "static", 32, 40)
    steps = [mqa(x[:, :20], cache, 0)] + [mqa(x[:, t:t + 1], cache, t) for t in range(20, 40)]
    say("cached decode vs full forward max |diff|:", float((torch.cat(steps, 1) - mha(x)).abs().max()))
