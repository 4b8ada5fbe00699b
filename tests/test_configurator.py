"""configurator.py: config files, --key=value overrides, type checks, unknown keys."""

import pytest

from configurator import ConfigError, check_value, load_config

DEFAULTS = {
    "batch_size": 8,
    "learning_rate": 1e-3,
    "compile": True,
    "dataset": "shakespeare",
    "betas": (0.9, 0.95),
    "ddl_dv": None,
}


def test_overrides_are_literals_checked_against_the_default_type():
    config = load_config(
        DEFAULTS, ["--batch_size=16", "--learning_rate=1", "--compile=False", "--betas=(0.9, 0.99)"]
    )
    assert config["batch_size"] == 16
    assert config["learning_rate"] == 1.0 and isinstance(config["learning_rate"], float)  # int -> float
    assert config["compile"] is False
    assert config["betas"] == (0.9, 0.99)
    assert DEFAULTS["batch_size"] == 8  # the defaults are not mutated


def test_strings_need_no_quotes_and_stay_strings():
    assert load_config(DEFAULTS, ["--dataset=fineweb_edu"])["dataset"] == "fineweb_edu"
    assert load_config(DEFAULTS, ["--dataset='a b'"])["dataset"] == "a b"
    assert load_config(DEFAULTS, ["--dataset=123"])["dataset"] == "123"  # a run name may look like a number
    # a key whose default is None takes any literal (the model validates it)
    assert load_config(DEFAULTS, ["--ddl_dv=4"])["ddl_dv"] == 4


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--batch_size=2.5", "key 'batch_size' expects int"),
        ("--batch_size=True", "key 'batch_size' expects int"),  # bool is not an int here
        ("--compile=1", "key 'compile' expects bool"),
        ("--learning_rate=fast", "cannot parse 'fast'"),
        ("--betas=(0.9,)", "expects tuple of length 2"),
        ("--dataset=[1]", None),  # a non-string literal for a string key is the raw text
        ("--batchsize=4", "unknown config key 'batchsize'. Did you mean batch_size?"),
        ("--zzz=1", "unknown config key 'zzz'."),
        ("batch_size=4", "cannot read config file 'batch_size=4'"),
        ("-batch_size=4", "expected a config file path or --key=value"),
        ("--batch_size", "expected a config file path or --key=value"),
    ],
)
def test_bad_overrides(arg, message):
    if message is None:
        assert load_config(DEFAULTS, [arg])["dataset"] == "[1]"
        return
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULTS, [arg])
    assert message in str(e.value)


def test_config_files_apply_in_order_with_later_overrides(tmp_path):
    base = tmp_path / "base.py"
    base.write_text(
        "import math\nbatch_size = 4\nlearning_rate = 6e-4\n_private = 1\nhelper = math.sqrt(4)\n"
    )
    more = tmp_path / "more.py"
    more.write_text("batch_size = batch_size * 2  # a file can read what earlier ones set\n")
    with pytest.raises(ConfigError, match="unknown config key 'helper'"):
        load_config(DEFAULTS, [str(base)])
    base.write_text("import math\nbatch_size = 4\nlearning_rate = 6e-4\n_private = 1\n")
    config = load_config(DEFAULTS, [str(base), str(more), "--learning_rate=1e-4"])
    assert config["batch_size"] == 8 and config["learning_rate"] == 1e-4
    assert set(config) == set(DEFAULTS)


def test_config_file_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("learnin_rate = 1e-3\n")
    with pytest.raises(
        ConfigError, match=r"bad.py': unknown config key 'learnin_rate'. Did you mean learning_rate"
    ):
        load_config(DEFAULTS, [str(bad)])
    bad.write_text("compile = 'yes'\n")
    with pytest.raises(ConfigError, match=r"bad.py': key 'compile' expects bool"):
        load_config(DEFAULTS, [str(bad)])


def test_check_value_float_key_rejects_bool():
    with pytest.raises(ConfigError):
        check_value("learning_rate", True, 1e-3)
    assert check_value("learning_rate", 3, 1e-3) == 3.0


@pytest.mark.parametrize(
    "source, message",
    [
        ("batch_size = 4\nif True\n    batch_size = 8\n", r"bad.py', line 2: syntax error"),
        ("batch_size = 4\nlearning_rate = 1 / 0\n", r"bad.py', line 2: ZeroDivisionError: division by zero"),
        ("import os\nbatch_size = int(os.environ['NOPE_NOT_SET'])\n", r"bad.py', line 2: KeyError"),
    ],
)
def test_config_file_that_raises_names_the_file_and_line(tmp_path, source, message):
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    with pytest.raises(ConfigError, match=message):
        load_config(DEFAULTS, [str(bad)])


def test_key_help_lists_defaults_with_the_comment_of_their_assignment(tmp_path):
    from configurator import key_help

    source = tmp_path / "keys.py"
    source.write_text(
        "batch_size = 8  # rows per step\n"
        "# a block comment is not a key's line\n"
        "learning_rate = 1e-3\n"
        "class Config:\n"
        "    ddl_dv: int | None = None  # None: the variant's default\n"
    )
    text = key_help(DEFAULTS, [(str(source), None), (str(source), "Config")])
    lines = {line.split()[0]: line for line in text.splitlines()}
    assert set(lines) == set(DEFAULTS)
    batch, dv = lines["batch_size"], lines["ddl_dv"]
    assert batch.startswith("  batch_size = 8 ") and batch.endswith("# rows per step")
    assert dv.startswith("  ddl_dv = None ") and dv.endswith("# None: the variant's default")
    assert batch.index("#") == dv.index("#")  # the comments in one column
    assert lines["learning_rate"] == "  learning_rate = 0.001"  # no comment on its line
    assert lines["betas"] == "  betas = (0.9, 0.95)"


@pytest.mark.parametrize(
    "arg, element",
    [
        ('--betas=(0.9,"a")', "key 'betas[1]' expects float (default 0.95), got str 'a'"),
        ("--betas=(True, 0.95)", "key 'betas[0]' expects float (default 0.9), got bool True"),
        ("--betas=[0.9, None]", "key 'betas[1]' expects float (default 0.95), got NoneType None"),
        ("--lengths=(256, 5.5)", "key 'lengths[1]' expects int (default 512), got float 5.5"),
        ("--lengths=('256', 512)", "key 'lengths[0]' expects int (default 256), got str '256'"),
    ],
)
def test_tuple_keys_check_each_element(tmp_path, arg, element):
    defaults = {**DEFAULTS, "lengths": (256, 512)}
    with pytest.raises(ConfigError) as e:
        load_config(defaults, [arg])
    assert element in str(e.value)
    key, value = arg[2:].split("=", 1)
    config = tmp_path / "config.py"  # the same check on a config file's assignment
    config.write_text(f"{key} = {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(defaults, [str(config)])
    assert f"config file '{config}': {element}" in str(e.value)
    # well-typed elements pass, a float key's ints become floats, a list becomes a tuple
    good = load_config(defaults, ["--betas=[0.9, 1]", "--lengths=(128, 1024)"])
    assert good["betas"] == (0.9, 1.0) and type(good["betas"][1]) is float
    assert good["lengths"] == (128, 1024)
