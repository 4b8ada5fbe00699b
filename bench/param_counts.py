"""Print the parameter counts of every residual x attention variant at both preset sizes.

    python bench/param_counts.py

Models are built on the meta device: nothing is allocated, so this runs in seconds on any machine.
Counts include the tied embedding / LM head once (50304 x d); d_v = 4 and K = 4 for ddl-cc / ddl-tc.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model import GPT, GPTConfig  # noqa: E402

RESIDUALS = [
    ("additive", {}),
    ("ddl (d_v=1)", dict(residual="ddl")),
    ("ddl write-only", dict(residual="ddl", ddl_erase=False)),
    ("ddl-cc +EC", dict(residual="ddl-cc")),
    ("ddl-cc no EC", dict(residual="ddl-cc", ddl_ec=False)),
    ("ddl-tc +EC", dict(residual="ddl-tc")),
    ("ddl-tc no EC", dict(residual="ddl-tc", ddl_ec=False)),
    ("ddl-tc +EC write-only", dict(residual="ddl-tc", ddl_erase=False)),
]
ATTENTIONS = [
    ("softmax", dict(attention="softmax")),
    ("deltaformer w=q", dict(attention="deltaformer", deltaformer_w="q")),
    ("deltaformer w=k", dict(attention="deltaformer", deltaformer_w="k")),
    ("deltaformer w=proj", dict(attention="deltaformer", deltaformer_w="proj")),
]


def count(size, **overrides):
    with torch.device("meta"):
        return GPT(GPTConfig.preset(size, **overrides)).num_params()


def main():
    for size in ("gpt2-small", "gpt2-medium"):
        print(f"\n{size}: parameters")
        print(f"| {'residual':<22} | " + " | ".join(f"{name:>18}" for name, _ in ATTENTIONS) + " |")
        print(f"|{'-' * 24}|" + "|".join("-" * 19 + ":" for _ in ATTENTIONS) + "|")
        for rname, rargs in RESIDUALS:
            cells = [f"{count(size, **rargs, **aargs):,}" for _, aargs in ATTENTIONS]
            print(f"| {rname:<22} | " + " | ".join(f"{c:>18}" for c in cells) + " |")


if __name__ == "__main__":
    main()
