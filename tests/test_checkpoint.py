"""checkpoint.py: the safe checkpoint loader, atomic saves on a full disk, the resumed log's lines."""

import dataclasses
import os
import pickle

import pytest
import torch

from checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model,
    log_lines_before,
    model_config,
    save_checkpoint,
    size_text,
    start_log,
)
from model import GPT, GPTConfig

CFG = GPTConfig(n_layer=1, n_head=2, head_dim=8, n_embd=16, block_size=8, vocab_size=32)


def checkpoint():
    model = GPT(CFG)
    return {"model": model.state_dict(), "model_args": dataclasses.asdict(CFG), "iter_num": 3}


class Foreign:
    pass


def damaged(kind, good):
    return {
        "truncated": good[: len(good) // 2],
        "random": os.urandom(4096),
        "empty": b"",
        "text": b"hello\n",
        "pickle": pickle.dumps({"model": 1}),
    }[kind]


@pytest.mark.parametrize("kind", ["truncated", "random", "empty", "text", "pickle", "objects"])
def test_unreadable_checkpoints_are_one_line_naming_the_file(tmp_path, kind):
    path = str(tmp_path / "ckpt.pt")
    torch.save(checkpoint(), path)
    if kind == "objects":  # a pickle that would run code on an unsafe load
        torch.save({"model": Foreign(), "model_args": {}}, path)
    else:
        with open(path, "rb") as f:
            good = f.read()
        with open(path, "wb") as f:
            f.write(damaged(kind, good))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    message = str(e.value)
    assert message.startswith(path) and "\n" not in message
    assert "weights_only" not in message


def test_random_bytes_are_not_a_checkpoint_and_unsafe_objects_are_named(tmp_path):
    import random

    path = str(tmp_path / "ckpt.pt")
    for seed in range(8):  # torch.load fails on these in several ways (UnpicklingError, IndexError, ...)
        data = random.Random(seed).randbytes(4096)
        assert data[:1] != b"\x80" and data[:2] != b"PK"  # neither a pickle nor a zip: arbitrary bytes
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path)
        assert str(e.value).startswith(f"{path}: not a checkpoint (4,096 bytes"), (seed, str(e.value))
    for legacy in (False, True):  # objects an unsafe load would construct, in both of torch.save's formats
        torch.save({"model": Foreign(), "model_args": {}}, path, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(CheckpointError, match="holds objects other than tensors"):
            load_checkpoint(path)


def test_missing_keys_and_missing_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(path)
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match="no 'model_args'"):
        load_checkpoint(path)
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="holds a list"):
        load_checkpoint(path)


def test_load_model_round_trip_and_bad_model_args(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    ckpt = checkpoint()
    save_checkpoint(ckpt, path)
    model, loaded = load_model(path)
    assert not model.training and loaded["iter_num"] == 3
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in model.state_dict().items())
    assert model_config(ckpt["model_args"]) == CFG
    with pytest.raises(CheckpointError, match="ckpt.pt: model_args"):
        model_config({**ckpt["model_args"], "residual": "nope"}, path)
    torch.save({**ckpt, "model_args": {**ckpt["model_args"], "n_embd": 32}}, path)
    with pytest.raises(CheckpointError, match="weights do not fit"):
        load_model(path)


def test_full_disk_keeps_the_previous_checkpoint(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint({"x": torch.zeros(3)}, path)
    with open(path, "rb") as f:
        good = f.read()
    os.symlink("/dev/full", path + ".tmp")  # every write to the temp file fails with ENOSPC
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(checkpoint(), path)
    message = str(e.value)
    assert message.startswith(f"no space left on {tmp_path}: need ~") and "for ckpt.pt" in message
    assert "previous ckpt.pt is kept" in message
    assert not os.path.lexists(path + ".tmp")
    with open(path, "rb") as f:
        assert f.read() == good
    assert torch.equal(load_checkpoint(path, required=())["x"], torch.zeros(3))


def test_size_text():
    assert [size_text(n) for n in (0, 1000, 5 * 2**10, 3.45 * 2**20, 345 * 2**20, 1.25 * 2**30)] == [
        "0 bytes",
        "1000 bytes",
        "5 KB",
        "3.5 MB",
        "345 MB",
        "1.2 GB",
    ]


def test_log_lines_before_drops_a_torn_last_line_and_names_bad_ones(tmp_path):
    path = tmp_path / "log.jsonl"
    lines = [
        '{"iter": 0, "val_loss": 4.0}\n',
        '{"iter": 0, "train_loss": 4.1}\n',
        '{"iter": 1, "train_loss": 4.0}\n',
        '{"iter": 2, "val_loss": 3.9}\n',
        '{"iter": 2, "train_loss": 3.8}\n',
    ]
    path.write_text("".join(lines) + '{"iter": 3, "tra')
    warnings = []
    assert log_lines_before(str(path), 2, warn=warnings.append) == lines[:4]
    assert warnings == [f"warning: {path}:6: dropped a cut-short last line (a run stopped while writing it)"]
    path.write_text("".join(lines[:2]) + "oops\n" + "".join(lines[2:]))
    with pytest.raises(CheckpointError, match="log.jsonl:3: not a log record"):
        log_lines_before(str(path), 2)
    path.write_text("".join(lines) + '{"iter": 3, "tra\n')  # a complete line that is wrong is no torn line
    with pytest.raises(CheckpointError, match="log.jsonl:6"):
        log_lines_before(str(path), 2)
    assert log_lines_before(str(tmp_path / "missing.jsonl"), 2) == []


def test_start_log_replaces_atomically(tmp_path):
    path = str(tmp_path / "log.jsonl")
    with open(path, "w") as f:
        f.write("old\n")
    with start_log(path, ["a\n", "b\n"]) as f:
        f.write("c\n")
    with open(path) as f:
        assert f.read() == "a\nb\nc\n"
    assert os.listdir(tmp_path) == ["log.jsonl"]


def test_a_checkpoint_of_an_older_model_py_is_named(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    ckpt = checkpoint()
    old_args = {k: v for k, v in ckpt["model_args"].items() if k not in ("init", "norm_eps")}
    torch.save({**ckpt, "model_args": old_args}, path)
    with pytest.raises(CheckpointError, match=r"ckpt.pt: model_args do not fit this model.py: .*older"):
        load_model(path)
