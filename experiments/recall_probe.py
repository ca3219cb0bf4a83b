"""One MQAR training of one seed, outside task=recall: how many steps a setting needs before a
preset is sized (the generators, the training loop and the accuracy are task=recall's own).

    python experiments/recall_probe.py VOCAB PAIRS SEQ_LEN STEPS D_MODEL LAYERS KV_HEADS LR
    python experiments/recall_probe.py 64 8 48 600 64 2 1 0.003   # MQA of 4 heads, 8 pairs in 48 tokens

Prints the held-out accuracy (256 sequences, eval seed 1) and the wall time; 4 query heads,
batch 32, seed 0, one torch thread.
"""

import time
from typing import List, Optional

import torch
from _common import Parser, positive_float, positive_int, run_main, say

from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.train import TrainConfig
from kvbench.model import Decoder
from kvbench.quality.recall import Condition, accuracy, eval_set, train_stream
from kvbench.quality.train import train

NAMES = ("VOCAB", "PAIRS", "SEQ_LEN", "STEPS", "D_MODEL", "LAYERS", "KV_HEADS")


def main(argv: Optional[List[str]] = None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    for name in NAMES:
        parser.add_argument(name, type=positive_int)
    parser.add_argument("LR", type=positive_float)
    args = parser.parse_args(argv)
    V, P, T, steps, d, L, kv = (getattr(args, name) for name in NAMES)
    lr = args.LR
    torch.set_num_threads(1)
    mc = ModelConfig(name="probe", num_layers=L, d_model=d, num_heads=4, preset_kv_heads=4, ffn_dim=2 * d,
                     vocab_size=V, max_seq_len=256)
    torch.manual_seed(0)
    model = Decoder(mc, AttentionConfig.for_heads(4, kv))
    cond = Condition("mqar", T, num_pairs=P)
    budget = TrainConfig(steps=steps, batch_size=32, seq_len=T, lr=lr, warmup_steps=20, eval_every=steps, log_every=50)
    start = time.time()
    result = train(model, budget, None, seed=0, stream=train_stream([cond], 32, V, 4, 0), evaluate_fn=lambda m: {})
    x, y = eval_set(cond, 256, V, 4, 1)
    say(f"V={V} P={P} T={T} steps={steps} d={d} L={L} kv={kv}: acc={accuracy(model, 'mqar', x, y):.3f} "
        f"loss={result['train_loss']:.3f} {time.time() - start:.1f}s")


if __name__ == "__main__":
    run_main(main)
