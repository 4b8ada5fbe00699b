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


# ---- the declared versions: requirements.txt, the README's tested ranges and what is installed ----


def requirements():
    from packaging.requirements import Requirement

    with open(os.path.join(REPO, "requirements.txt"), encoding="utf-8") as f:
        lines = [line.split("#")[0].strip() for line in f]
    return [Requirement(line) for line in lines if line]


def readme_ranges():
    """{name: (low, high)} of the README's "NAME LOW to HIGH" in its Install section (names lowercased)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        section = " ".join(f.read().split("## Install", 1)[1].split("\n## ", 1)[0].split())
    found = re.findall(r"([A-Za-z][\w-]*) (\d+(?:\.\d+)+) to (\d+(?:\.\d+)*(?:\.x)?)\b", section)
    return {name.lower(): (low, high) for name, low, high in found}


def below(version):
    """The release just before `version` (2.11 -> 2.10.9999, 0.4.13 -> 0.4.12)."""
    parts = [int(p) for p in version.split(".")]
    if parts[-1] > 0:
        return ".".join(map(str, parts[:-1] + [parts[-1] - 1]))
    return ".".join(map(str, parts[:-2] + [parts[-2] - 1, 9999]))


def test_every_capped_pin_is_the_readmes_tested_range():
    # an upper bound is the first release series not yet tested: the README's "torch 2.11 to 2.14" is
    # exactly torch>=2.11,<2.15 (2.14.x in, 2.15 out), "lm-eval 0.4.13 to 0.4.x" is lm-eval>=0.4.13,<0.5
    ranges = readme_ranges()
    capped = [r for r in requirements() if any(s.operator in ("<", "<=", "==", "~=") for s in r.specifier)]
    assert {r.name.lower() for r in capped} >= {"torch", "triton"}
    for r in capped:
        assert r.name.lower() in ranges, f"{r}: the README's Install section gives no '{r.name} A to B' range"
        low, high = ranges[r.name.lower()]
        series = high.removesuffix(".x")
        last = [int(p) for p in series.split(".")]
        first_untested = ".".join(map(str, last[:-1] + [last[-1] + 1]))
        inside = [low, f"{series}.9999"]
        outside = [below(low), first_untested]
        contains = lambda v, r=r: r.specifier.contains(v, prereleases=True)
        assert all(map(contains, inside)) and not any(map(contains, outside)), (str(r), low, high)


def test_the_installed_versions_are_declared():
    # a version outside requirements.txt's ranges has not been tested here: run the suite with it, then
    # widen the range (and the README's) in the same change
    from importlib.metadata import PackageNotFoundError, version

    checked = 0
    for r in requirements():
        if r.marker is not None and not r.marker.evaluate():
            continue
        try:
            installed = version(r.name)
        except PackageNotFoundError:
            continue
        assert r.specifier.contains(installed, prereleases=True), f"{r.name} {installed} is not in {r}"
        checked += 1
    assert checked >= 3  # torch, numpy and pytest at least
