"""Data loader of the shakespeare_cloze lm-eval task: the JSONL files beside this file (written by
data/shakespeare_cloze.py), read from here so that the task works from any working directory, offline."""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SPLITS = ("test", "fewshot")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load(**kwargs):
    """{split: datasets.Dataset} (lm-eval's custom_dataset hook; it passes the task metadata, unused)."""
    import datasets

    return datasets.DatasetDict(
        {s: datasets.Dataset.from_list(read_jsonl(os.path.join(HERE, f"{s}.jsonl"))) for s in SPLITS}
    )
