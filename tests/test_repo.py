"""The repository speaks only of itself: no tracked file talks about how it was built (work sessions,
issue numbers, GPU calls, machine kinds) or points at files that are not in the repository."""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = [
    r"\bsessions?\b",
    r"\bissues?[ _-]?\d",
    r"\bissue_",
    r"\bdevice (call|run|session|README)",
    r"\bcall [0-9]\b",
    r"nvidia-h200",
    r"\b(DEVELOPERS|METHOD|KINDS|H200|HOPPER)\.md\b",
]


def tracked_text_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for path in out.splitlines():
        full = os.path.join(REPO, path)
        if path == "tests/test_repo.py" or not os.path.isfile(full):
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
    for bad in ["the session-2 sweep", "Issue 5's target", "issue_flops_per_token", "device call 3",
                "an nvidia-h200-x2 machine", "see DEVELOPERS.md", "call 4 at a7d5eac"]:  # fmt: skip
        assert pattern.search(bad), bad
    for fine in ["the recall 5 metric", "a tissue 3 mm thick", "issued 2 warnings", "METHOD.md5"]:
        assert not pattern.search(fine), fine
