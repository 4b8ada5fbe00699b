"""The repository speaks only of itself: no tracked file tells the story of its own making (who worked
when, tracker numbers, GPU runs, machine kinds) or points at files that are not in the repository.
The patterns below are written with character classes, and the examples assembled from pieces, so that
this file does not itself contain the words it looks for."""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = [
    r"\bse[s]sions?\b",
    r"\biss[u]es?[ _-]?\d",
    r"\biss[u]e_",
    r"\bdevi[c]e (call|run|se[s]sion|READ[M]E)",
    r"\bcal[l] [0-9]\b",
    r"nvidia-h[2]00",
    r"\b(DEVELOPER[S]|METHO[D]|KIND[S]|H20[0]|HOPPE[R])\.md\b",
]


def tracked_text_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for path in out.splitlines():
        full = os.path.join(REPO, path)
        if not os.path.isfile(full):
            continue
        try:
            with open(full, encoding="utf-8") as f:
                yield path, f.read()
        except UnicodeDecodeError:
            continue


def test_no_file_speaks_of_how_it_was_built():
    pattern = re.compile("|".join(FORBIDDEN), re.IGNORECASE)
    hits = []
    for path, text in tracked_text_files():
        for n, line in enumerate(text.splitlines(), 1):
            m = pattern.search(line)
            if m:
                hits.append(f"{path}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not hits, "\n".join(hits[:50]) + (f"\n... {len(hits)} in all" if len(hits) > 50 else "")


def test_the_pattern_catches_what_it_should():
    pattern = re.compile("|".join(FORBIDDEN), re.IGNORECASE)
    ses, iss, dev, cal = "ses" + "sion", "Iss" + "ue", "dev" + "ice", "ca" + "ll"
    for bad in [f"the {ses}-2 sweep", f"{iss} 5's target", f"{iss.lower()}_flops_per_token",
                f"{dev} {cal} 3", "an nvidia-" + "h200-x2 machine", "see DEVELOPERS" + ".md",
                f"{cal} 4 at a7d5eac"]:  # fmt: skip
        assert pattern.search(bad), bad
    for fine in ["the rec" + "all 5 metric", "a tiss" + "ue 3 mm thick", "issued 2 warnings",
                 "METHO" + "D.md5"]:  # fmt: skip
        assert not pattern.search(fine), fine
