"""Config handling for train.py: defaults <- config files (plain Python) <- --key=value overrides.

    python train.py configs/shakespeare.py --batch_size=8 --residual=ddl-cc --compile=False

A config file is executed as Python; every top-level name it sets (not starting with "_", not a module,
function or class) must be a known key. An override value is parsed with ast.literal_eval, or taken as a
plain string when that fails and the key holds a string (so --residual=ddl-cc needs no quotes). Every
value is checked against the type of the key's default: a bool key takes only True/False, an int key
only ints, a float key ints or floats (stored as float), a tuple key a list/tuple of the same length;
a key whose default is None takes any literal. An unknown key fails with the closest known keys.
command_line adds the usage and --help (every key with its default and comment); check_values checks
allowed values and lower bounds.
"""

import ast
import difflib
import io
import sys
import tokenize
import traceback
import types


class ConfigError(ValueError):
    pass


def _unknown_key(key, known, where):
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"{where}: unknown config key '{key}'.{hint}")


def check_value(key, value, default, where="config"):
    """Return `value` converted to the type of `default`, or raise ConfigError naming the key."""
    if default is None:
        return value
    want = type(default).__name__
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, str):
        if isinstance(value, str):
            return value
    elif isinstance(default, (tuple, list)):
        if isinstance(value, (tuple, list)) and len(value) == len(default):
            items = enumerate(zip(value, default))
            return tuple(check_value(f"{key}[{i}]", v, d, where) for i, (v, d) in items)
        want = f"{want} of length {len(default)}"
    else:
        raise ConfigError(f"{where}: key '{key}' has a default of unsupported type {type(default).__name__}")
    raise ConfigError(
        f"{where}: key '{key}' expects {want} (default {default!r}), got {type(value).__name__} {value!r}"
    )


def parse_override(arg, defaults):
    """'--key=value' -> (key, value) checked against defaults[key]."""
    if not arg.startswith("--") or "=" not in arg:
        raise ConfigError(f"argument '{arg}': expected a config file path or --key=value")
    key, text = arg[2:].split("=", 1)
    if key not in defaults:
        raise _unknown_key(key, list(defaults), f"argument '{arg}'")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        # bare words are strings for string keys (--dataset=shakespeare); for other keys it's an error
        if isinstance(defaults[key], str) or defaults[key] is None:
            value = text
        else:
            raise ConfigError(
                f"argument '{arg}': cannot parse {text!r} as a Python literal for key '{key}' "
                f"(default {defaults[key]!r})"
            ) from None
    if isinstance(defaults[key], str) and not isinstance(value, str):
        value = text  # --wandb_run_name=123 is the string "123"
    return key, check_value(key, value, defaults[key], f"argument '{arg}'")


def apply_file(path, config, defaults):
    """Execute the config file at `path` and return config updated with the keys it set."""
    try:
        with open(path) as f:
            source = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file '{path}': {e.strerror}") from None
    namespace = dict(config)  # a file may read earlier values, e.g. n_embd = 2 * n_embd
    try:
        code = compile(source, path, "exec")
    except SyntaxError as e:
        raise ConfigError(f"config file '{path}', line {e.lineno}: syntax error: {e.msg}") from None
    try:
        exec(code, namespace)
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        line = frames[-1].lineno if frames else "?"
        raise ConfigError(f"config file '{path}', line {line}: {type(e).__name__}: {e}") from None
    new = dict(config)
    for key, value in namespace.items():
        if key.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        if key not in defaults:
            raise _unknown_key(key, list(defaults), f"config file '{path}'")
        new[key] = check_value(key, value, defaults[key], f"config file '{path}'")
    return new


def load_config(defaults, argv):
    """defaults: {key: default value}; argv: config files and --key=value, applied left to right."""
    config = dict(defaults)
    for arg in argv:
        if arg.startswith("-"):
            key, value = parse_override(arg, defaults)
            config[key] = value
        else:
            config = apply_file(arg, config, defaults)
    return config


def key_help(defaults, sources):
    """One line per key: `name = default  # comment`, the comment taken from the key's assignment in the
    source files `sources`, [(path, class name or None for the module level)] (the first one found)."""
    comments = {}
    for path, class_name in sources:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        notes = {  # line number -> the comment that ends it
            tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT
        }
        body = ast.parse(source).body
        if class_name is not None:
            body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == class_name), [])
        for node in body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in defaults:
                    comments.setdefault(target.id, notes.get(node.end_lineno, ""))
    items = [(f"{key} = {value!r}", comments.get(key, "")) for key, value in defaults.items()]
    width = max(len(a) for a, _ in items) + 2
    return "\n".join(f"  {a:<{width}}{'# ' + b if b else ''}".rstrip() for a, b in items)


def command_line(defaults, argv, usage, sources):
    """load_config(defaults, argv); without arguments exit with `usage`, with -h or --help print it and
    key_help(defaults, sources) and exit 0 (usage, not a 124M-parameter run on a CPU)."""
    if not argv:
        sys.exit(usage)
    if {"-h", "--help"} & set(argv):
        print(f"{usage}\n\nconfig keys (default, meaning):\n{key_help(defaults, sources)}")
        sys.exit(0)
    return load_config(defaults, argv)


def check_values(config, choices, at_least):
    """ConfigError for the first key whose value is not one of choices[key] or is below at_least[key]."""
    for key, allowed in choices.items():
        if config[key] not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {config[key]!r}")
    for key, low in at_least.items():
        if config[key] < low:
            raise ConfigError(f"{key} must be >= {low}, got {config[key]}")
