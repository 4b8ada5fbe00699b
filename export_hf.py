"""
Export a checkpoint (out_dir/ckpt.pt written by train.py) as a Hugging Face folder:

    python export_hf.py --out_dir=out --to=out/hf            # --overwrite replaces an existing folder

The folder loads offline with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and
`AutoTokenizer.from_pretrained(folder)`, and runs in `lm_eval --model hf`. It holds config.json (the
checkpoint's GPTConfig fields in a DDLGPTConfig, auto_map set), model.safetensors, generation_config.json,
the GPT-2 tokenizer (vocab.json and merges.txt: the files data/tokenizer.py verifies, so the same ids) and
the code: hf_model.py as modeling_ddl_gpt.py, model.py and every module of ops/ it imports. transformers
copies only the .py files beside the modeling file, found through their `from .NAME import` lines, so each
module is written flat (ops/ddl/naive.py -> ops_ddl_naive.py) with its imports of the others made
relative: the same code as the repo's, nothing else changed. The folder is written atomically (a temp
folder beside it, then a rename): a failed export leaves no half folder and loses no old one.
"""

import argparse
import ast
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.abspath(__file__))
MODELING = "modeling_ddl_gpt"  # the modeling file's module name in the folder
# transformers' loader follows these lines (dynamic_module_utils.get_relative_imports)
EOT, EOT_TEXT = 50256, "<|endoftext|>"
LOADER_IMPORT = re.compile(r"^\s*from\s+\.(\S+)\s+import", flags=re.MULTILINE)


class ExportError(Exception):
    """An export that cannot be made; the message is one line."""


def flat_name(module):
    return MODELING if module == "hf_model" else module.replace(".", "_")


def module_path(module):
    """The repo's file of a dotted module name, or None for a module from elsewhere (torch, triton...)."""
    base = os.path.join(REPO, *module.split("."))
    return next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(p)), None)


def absolute(node, module, path):
    """The dotted name an ImportFrom node of `module` (its file: path) imports from."""
    if node.level == 0:
        return node.module
    package = module.split(".")[: None if path.endswith("__init__.py") else -1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def flatten(module, text, path):
    """(text with its imports of repo modules made flat and relative, the repo modules it imports)."""
    lines, needed, edits = text.splitlines(keepends=True), [], []
    for node in ast.walk(ast.parse(text)):
        where = f"{os.path.relpath(path, REPO)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import) and any(module_path(a.name) for a in node.names):
            raise ExportError(f"{where}: `import` of a repo module; export_hf.py needs `from M import names`")
        if not isinstance(node, ast.ImportFrom):
            continue
        target = absolute(node, module, path)
        if module_path(target) is None:
            continue
        subs = [a for a in node.names if module_path(f"{target}.{a.name}")]
        if subs and (len(subs) < len(node.names) or node.end_lineno != node.lineno):
            raise ExportError(f"{where}: import submodules one line at a time, apart from other names")
        if subs:  # from . import triton as _triton -> from . import ops_ddl_triton as _triton
            needed += [f"{target}.{a.name}" for a in subs]
            new = "from . import " + ", ".join(
                f"{flat_name(f'{target}.{a.name}')} as {a.asname or a.name}" for a in subs
            )
            edits.append((node.lineno - 1, node.col_offset, node.end_col_offset, new))
        else:  # from ops.ddl import (...) -> from .ops_ddl import (...)
            needed.append(target)
            head = re.match(r"from\s+[.\w]*\s+import", lines[node.lineno - 1][node.col_offset :])
            edits.append(
                (
                    node.lineno - 1,
                    node.col_offset,
                    node.col_offset + head.end(),
                    f"from .{flat_name(target)} import",
                )
            )
    for i, a, b, new in sorted(edits, reverse=True):
        lines[i] = lines[i][:a] + new + lines[i][b:]
    return "".join(lines), needed


def code_files():
    """{file name: text} of the folder's code: hf_model.py and the repo modules it imports, recursively."""
    files, todo = {}, ["hf_model"]
    while todo:
        module = todo.pop()
        name = flat_name(module) + ".py"
        if name in files:
            continue
        path = module_path(module)
        with open(path, encoding="utf-8") as f:
            text, needed = flatten(module, f.read(), path)
        files[name] = (
            f"# {os.path.relpath(path, REPO)} of the ddl repo, its imports made flat (export_hf.py)\n" + text
        )
        todo += needed
    # Name every module once where the loader looks, so that it copies each (never run).
    files[MODELING + ".py"] += (
        "\n\nif False:  # the modules beside this file, for transformers' loader\n"
        + "".join(
            f"    from .{name[:-3]} import __doc__\n" for name in sorted(files) if name != MODELING + ".py"
        )
    )
    for name, text in files.items():  # every line the loader follows names a file of the folder
        for m in LOADER_IMPORT.findall(text):
            if f"{m}.py" not in files:
                raise ExportError(
                    f"{name}: transformers' loader would look for {m}.py, which the export lacks"
                )
    return files


def write_tokenizer(folder, block_size):
    """GPT-2's vocab.json and merges.txt (OpenAI's encoder.json and vocab.bpe, checked against the hashes
    tiktoken pins, as data/tokenizer.py does) and a GPT2Tokenizer config: <|endoftext|> is special."""
    from data.tokenizer import ENCODER_JSON_SHA256, VOCAB_BPE_SHA256, bpe_files, verify_sha256

    vocab_bpe, encoder_json = bpe_files()
    for path, sha, name in (
        (vocab_bpe, VOCAB_BPE_SHA256, "merges.txt"),
        (encoder_json, ENCODER_JSON_SHA256, "vocab.json"),
    ):
        verify_sha256(path, sha)
        shutil.copyfile(path, os.path.join(folder, name))
    special = dict(bos_token=EOT_TEXT, eos_token=EOT_TEXT, unk_token=EOT_TEXT)
    write_json(os.path.join(folder, "special_tokens_map.json"), special)
    write_json(
        os.path.join(folder, "tokenizer_config.json"),
        dict(
            tokenizer_class="GPT2Tokenizer",
            model_max_length=block_size,
            add_prefix_space=False,
            add_bos_token=False,
            errors="replace",
            **special,
        ),
    )


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_folder(folder, gpt):
    """The model's files: config.json, model.safetensors, generation_config.json, the tokenizer, the code."""
    from safetensors.torch import save_file

    cfg = gpt.config
    # backend: the kernels' choice on the loading machine ("auto"), not the one the run trained with
    args = dict(dataclasses.asdict(cfg), backend="auto", dropout=0.0)
    classes = {"AutoConfig": "DDLGPTConfig", "AutoModelForCausalLM": "DDLGPTForCausalLM"}
    write_json(
        os.path.join(folder, "config.json"),
        dict(
            architectures=["DDLGPTForCausalLM"],
            auto_map={k: f"{MODELING}.{v}" for k, v in classes.items()},
            model_type="ddl_gpt",
            gpt=args,
            dtype="float32",
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.block_size,
            bos_token_id=EOT,
            eos_token_id=EOT,
            tie_word_embeddings=True,
        ),
    )
    write_json(
        os.path.join(folder, "generation_config.json"),
        dict(bos_token_id=EOT, eos_token_id=EOT, pad_token_id=EOT),
    )
    state = gpt.state_dict()
    del state["lm_head.weight"]  # tied to wte.weight: transformers ties it on load
    save_file(
        {f"gpt.{k}": v.float().contiguous() for k, v in state.items()},
        os.path.join(folder, "model.safetensors"),
        metadata={"format": "pt"},
    )
    write_tokenizer(folder, cfg.block_size)
    for name, text in code_files().items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)


def export(out_dir, to, overwrite=False):
    """Write the Hugging Face folder `to` of out_dir/ckpt.pt; ExportError (one line) on bad input."""
    from checkpoint import CheckpointError, load_model

    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        raise ExportError(f"no checkpoint at {path} (train one with train.py, or set --out_dir)")
    if os.path.lexists(to) and not (overwrite and os.path.isdir(to)):
        what = "exists" if os.path.isdir(to) else "exists and is not a folder"
        raise ExportError(f"--to={to} {what}; pass --overwrite to replace a folder")
    try:
        gpt, _ = load_model(path, "cpu")
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    parent, base = os.path.split(os.path.abspath(to))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.", dir=parent)
    try:
        write_folder(tmp, gpt)
        if os.path.isdir(to):  # --overwrite: the old folder goes only once the new one is complete
            old = tempfile.mkdtemp(prefix=f".{base}.old.", dir=parent)
            os.replace(to, os.path.join(old, base))
            os.replace(tmp, to)
            shutil.rmtree(old)
        else:
            os.replace(tmp, to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return to


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="export_hf.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out_dir", default="out", help="directory holding ckpt.pt (default: out)")
    p.add_argument("--to", default=None, help="the folder to write (default: OUT_DIR/hf)")
    p.add_argument("--overwrite", action="store_true", help="replace the --to folder if it exists")
    args = p.parse_args(argv)
    to = args.to or os.path.join(args.out_dir, "hf")
    try:
        export(args.out_dir, to, args.overwrite)
    except (ExportError, OSError) as e:
        p.error(str(e))
    print(f"{os.path.join(args.out_dir, 'ckpt.pt')} -> {to}", file=sys.stderr)


if __name__ == "__main__":
    main()
