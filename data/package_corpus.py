"""A real code-and-docs corpus with no download: the text files that ship inside installed Python packages.

    python data/package_corpus.py --out corpus.jsonl --max-mb 300 [ROOT ...]
    python data/fineweb_edu.py --input corpus.jsonl --out data/package_corpus --shard-tokens 5000000

Walks ROOT (default: every site-packages directory of this interpreter) for *.py, *.pyi, *.md, *.rst and
*.txt files, in sorted order (a folder's files by name, then its subfolders by name, whatever order the
filesystem lists them in), drops duplicates (same bytes), files that are not UTF-8 and files outside
200 B .. 1 MB, and writes one JSONL document {"text": ...} per file until --max-mb of text. The output
depends only on the files present, so the same installed packages give the same corpus. The first shard
data/fineweb_edu.py writes (shard 0, the validation split) comes from the first files in that order, so
validation text is held out from training.
"""

import argparse
import hashlib
import json
import os
import site
import sys

SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
MIN_BYTES, MAX_BYTES = 200, 1 << 20


def iter_files(roots):
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(SUFFIXES):
                    yield os.path.join(dirpath, name)


def build(roots, out, max_mb):
    seen, total, n = set(), 0, 0
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for path in iter_files(roots):
            try:
                size = os.path.getsize(path)
                if not MIN_BYTES <= size <= MAX_BYTES:
                    continue
                with open(path, "rb") as g:
                    raw = g.read()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            digest = hashlib.sha1(raw).digest()
            if digest in seen:
                continue
            seen.add(digest)
            f.write(json.dumps({"text": text}) + "\n")
            total, n = total + len(raw), n + 1
            if total >= max_mb * 1e6:
                break
    os.replace(tmp, out)
    return n, total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("roots", nargs="*", help="directories to walk (default: this Python's site-packages)")
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--max-mb", type=float, default=300.0, help="stop after this many MB of text")
    args = p.parse_args(argv)
    roots = args.roots or sorted({os.path.realpath(d) for d in site.getsitepackages() if os.path.isdir(d)})
    missing = [r for r in roots if not os.path.isdir(r)]
    if missing:
        sys.exit(f"package_corpus: not a directory: {missing[0]}")
    n, total = build(roots, args.out, args.max_mb)
    if n == 0:
        sys.exit(f"package_corpus: no text files found under {roots}")
    print(f"{args.out}: {n} files, {total / 1e6:.1f} MB of text from {roots}")


if __name__ == "__main__":
    main()
