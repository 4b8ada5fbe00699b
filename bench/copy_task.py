"""A 2-layer sanity check that every residual variant can learn something attention must do: copying.

    python bench/copy_task.py                       # the table quoted in model.py's docstring
    python bench/copy_task.py --steps 400 --only "ddl-cc v=linear"

Each row is 32 random tokens (vocab 64) followed by the same 32 again; the model sees 63 tokens and
predicts the next. The first half is unpredictable (ln 64 = 4.16 per token), the second half is a copy
(0 once learned), so the loss floor is about 2.08 and a model that cannot copy stays near 4.16. CPU, one
thread, float32, AdamW lr 3e-3, batch 16, d=64, 2 heads x 32; a few tens of seconds per variant.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model import GPT, GPTConfig  # noqa: E402

VOCAB, T = 64, 64
# ddl_v: "linear" = the spec's v = W_v c (default), "sigmoid" = the authors' 4 sigmoid(W_v c + b_v)
VARIANTS = {
    "additive": dict(residual="additive"),
    "ddl v=sigmoid": dict(residual="ddl", ddl_v="sigmoid"),
    "ddl-cc v=sigmoid": dict(residual="ddl-cc", ddl_v="sigmoid"),
    "ddl-tc v=sigmoid": dict(residual="ddl-tc", ddl_v="sigmoid"),
    "ddl-cc+deltaformer v=sigmoid": dict(residual="ddl-cc", attention="deltaformer", ddl_v="sigmoid"),
    "ddl-cc write-only v=sigmoid": dict(residual="ddl-cc", ddl_erase=False, ddl_v="sigmoid"),
    "ddl v=linear": dict(residual="ddl", ddl_v="linear"),
    "ddl-cc v=linear": dict(residual="ddl-cc", ddl_v="linear"),
}


def batch(gen, rows=16):
    first = torch.randint(0, VOCAB, (rows, T // 2), generator=gen)
    seq = torch.cat([first, first], dim=1)
    return seq[:, :-1], seq[:, 1:]


def run(overrides, steps, every):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, head_dim=32, block_size=T, vocab_size=VOCAB, **overrides)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps + 1):
        x, y = batch(gen)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0:
            losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument(
        "--only", choices=sorted(VARIANTS), action="append", help="run only these (repeatable)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.only or list(VARIANTS)
    header = " ".join(f"{'step ' + str(s):>9}" for s in range(0, args.steps + 1, args.every))
    print(f"| {'variant':<20} | {header} | seconds |")
    for name in names:
        t0 = time.time()
        losses = run(VARIANTS[name], args.steps, args.every)
        cells = " ".join(f"{x:>9.3f}" for x in losses)
        print(f"| {name:<20} | {cells} | {time.time() - t0:>7.0f} |", flush=True)


if __name__ == "__main__":
    main()
