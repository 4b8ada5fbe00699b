"""Which tests check what each option of bench/*.py changes (and that its bad values are refused): a table per
script, option -> test(s), walked against the script's real argparse parser and the flags it reads from its
argv by hand, so that an option added without a test, or a table naming a test that is gone, fails here."""

import ast
import glob
import inspect
import os
import sys

import pytest
from option_coverage import flags, missing, parser_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_attention  # noqa: E402
import bench_curves  # noqa: E402
import bench_data  # noqa: E402
import bench_ddl  # noqa: E402
import bench_ddp  # noqa: E402
import bench_infer  # noqa: E402
import bench_quality  # noqa: E402
import bench_train  # noqa: E402
import common  # noqa: E402
import compile_check  # noqa: E402
import run_state_tracking  # noqa: E402

R = "test_bench_rows.py::"
# common.py's row_parser, shared by bench_train.py and bench_infer.py, and the flag of a row's own process
ROWS = {
    "--models": [
        R + "test_row_flags_parse_lists_batches_and_literal_overrides",
        R + "test_gpt_takes_the_size_seq_overrides_device_and_backend",
        R + "test_infer_flags_select_rows",
    ],
    "--variants": [
        R + "test_row_flags_parse_lists_batches_and_literal_overrides",
        R + "test_row_flags_refusals",
        R + "test_train_flags_select_rows",
        "test_bench_train.py::test_cpu_smoke",
    ],
    "--batches": [
        R + "test_row_flags_parse_lists_batches_and_literal_overrides",
        R + "test_row_flags_refusals",
        R + "test_largest_batch_falls_back_after_each_out_of_memory",
        R + "test_forward_row_tokens_per_second_mfu_and_calls",
        "test_bench_train.py::test_cpu_smoke",
        "test_bench_train.py::test_batches_must_be_positive_integers",
    ],
    "--seq": [
        R + "test_gpt_takes_the_size_seq_overrides_device_and_backend",
        R + "test_measure_tokens_per_second_mfu_and_steps",
        R + "test_forward_row_tokens_per_second_mfu_and_calls",
    ],
    "--warmup": [
        R + "test_measure_tokens_per_second_mfu_and_steps",
        R + "test_forward_row_tokens_per_second_mfu_and_calls",
    ],
    "--steps": [
        R + "test_measure_tokens_per_second_mfu_and_steps",
        R + "test_forward_row_tokens_per_second_mfu_and_calls",
        R + "test_row_flags_refusals",
    ],
    "--compile": [
        R + "test_measure_tokens_per_second_mfu_and_steps",
        R + "test_forward_row_tokens_per_second_mfu_and_calls",
        R + "test_row_flags_parse_lists_batches_and_literal_overrides",
    ],
    "--ddl-backend": [
        R + "test_gpt_takes_the_size_seq_overrides_device_and_backend",
        R + "test_row_flags_refusals",
    ],
    "--time-limit": R + "test_run_rows_passes_the_time_limit_and_saves_each_row_to_out",
    "--device": [
        R + "test_gpt_takes_the_size_seq_overrides_device_and_backend",
        R + "test_row_flags_refusals",
        R + "test_measure_tokens_per_second_mfu_and_steps",
    ],
    "--model-overrides": [
        R + "test_row_flags_parse_lists_batches_and_literal_overrides",
        R + "test_gpt_takes_the_size_seq_overrides_device_and_backend",
        R + "test_row_flags_refusals",
    ],
    "--out": R + "test_run_rows_passes_the_time_limit_and_saves_each_row_to_out",
    "--job": [
        R + "test_job_main_runs_the_worker_on_its_job_file",
        R + "test_run_rows_passes_the_time_limit_and_saves_each_row_to_out",
    ],
}
TRAIN = {
    "--accum": [
        R + "test_measure_tokens_per_second_mfu_and_steps",
        R + "test_train_flags_select_rows",
        R + "test_train_flags_refusals",
        "test_bench_train.py::test_train_steps_accumulates_the_mean_gradient",
    ],
    "--profile": [
        R + "test_measure_tokens_per_second_mfu_and_steps",
        "test_bench_train.py::test_cpu_smoke_profile",
    ],
    "--profile-steps": [R + "test_profile_step_times_per_step_and_top", R + "test_train_flags_select_rows"],
    "--profile-top": [R + "test_profile_step_times_per_step_and_top", R + "test_train_flags_select_rows"],
    "--nanogpt": [
        R + "test_train_flags_select_rows",
        R + "test_train_flags_refusals",
        "test_bench_train.py::test_cpu_smoke_nanogpt_row",
    ],
    "--against": [
        R + "test_train_flags_select_rows",
        R + "test_train_flags_refusals",
        "test_bench_train.py::test_against_runs_each_variant_on_the_other_checkout_first",
    ],
    "--doc-mask": [
        R + "test_doc_mask_adds_each_variants_masked_row_right_after_it",
        R + "test_doc_mask_reaches_the_models_config",
        R + "test_train_flags_refusals",
        R + "test_measure_tokens_per_second_mfu_and_steps",
        R + "test_throughput_table_unmasked_ratio_is_against_the_same_variant_and_model",
        "test_bench_train.py::test_doc_mask_batches_are_documents_of_the_documented_length",
        "test_bench_train.py::test_every_row_trains_on_the_same_documents",
    ],
}
INFER = {
    "--sections": [
        R + "test_infer_flags_select_rows",
        R + "test_infer_flags_refusals",
        "test_bench_infer.py::test_cpu_smoke",
    ],
    "--decode-models": R + "test_infer_flags_select_rows",
    "--decode-batches": [
        R + "test_infer_flags_select_rows",
        R + "test_infer_flags_refusals",
        R + "test_decode_row_tokens_per_second_runs_and_cache_size",
    ],
    "--decode-modes": [
        R + "test_infer_flags_select_rows",
        R + "test_infer_flags_refusals",
        R + "test_decode_row_tokens_per_second_runs_and_cache_size",
    ],
    "--prompt": [
        R + "test_decode_row_tokens_per_second_runs_and_cache_size",
        R + "test_infer_flags_refusals",
        R + "test_infer_flags_select_rows",
    ],
    "--new": [
        R + "test_decode_row_tokens_per_second_runs_and_cache_size",
        R + "test_infer_flags_refusals",
        R + "test_infer_flags_select_rows",
    ],
    "--none-new": [
        R + "test_decode_row_tokens_per_second_runs_and_cache_size",
        R + "test_infer_flags_refusals",
        R + "test_infer_flags_select_rows",
    ],
    "--parallel": [
        R + "test_infer_flags_select_rows",
        R + "test_infer_flags_refusals",
        R + "test_run_rows_passes_the_time_limit_and_saves_each_row_to_out",
        "test_bench_common.py::test_cpu_slots_share_the_cores",
    ],
}
A = "test_bench_attention.py::"
ATTENTION = {
    "--no-fla": A + "test_tables_ratios_and_no_fla",
    "--json": [A + "test_flags_reach_each_shape_and_the_tables", A + "test_tables_ratios_and_no_fla"],
    "--profile": [
        A + "test_flags_reach_each_shape_and_the_tables",
        A + "test_kernel_split_sums_each_part_per_run",
    ],
    "--shapes": [
        A + "test_flags_reach_each_shape_and_the_tables",
        A + "test_shapes_must_be_four_positive_integers",
    ],
}
K = "test_bench_ddl.py::"
DDL = {
    "--quick": [
        K + "test_quick_and_sweeps_choose_the_cases_and_the_timer",
        K + "test_quick_leaves_out_torch_compile_and_the_bytes_are_passes_over_the_state",
    ],
    "--sweeps": [
        K + "test_quick_and_sweeps_choose_the_cases_and_the_timer",
        K + "test_main_needs_cuda_and_writes_out",
    ],
    "--out": K + "test_main_needs_cuda_and_writes_out",
}
P = "test_bench_ddp.py::"
DDP = {
    "--stage": [P + "test_main_stages_and_refusals", P + "test_train_command_per_stage"],
    "--variants": [P + "test_main_stages_and_refusals", P + "test_run_stage_slots_commands_and_failures"],
    "--gpus": [
        P + "test_run_stage_slots_commands_and_failures",
        P + "test_train_command_per_stage",
        P + "test_main_stages_and_refusals",
    ],
    "--iters": [P + "test_train_command_per_stage", P + "test_report_scaling_is_against_the_one_gpu_run"],
    "--skip": P + "test_report_scaling_is_against_the_one_gpu_run",
    "--warmup": P + "test_train_command_per_stage",
    "--batch-size": [
        P + "test_train_command_per_stage",
        P + "test_report_scaling_is_against_the_one_gpu_run",
    ],
    "--grad-accum": [
        P + "test_train_command_per_stage",
        P + "test_main_stages_and_refusals",
        P + "test_report_scaling_is_against_the_one_gpu_run",
    ],
    "--work": [
        P + "test_train_command_per_stage",
        P + "test_run_stage_slots_commands_and_failures",
        P + "test_report",
    ],
    "--out": [P + "test_report", P + "test_report_scaling_is_against_the_one_gpu_run"],
}
D = "test_bench_data.py::"
DATA = {
    "--workers": [D + "test_main_throughputs_and_flags", D + "test_refusals"],
    "--mb": [
        D + "test_main_throughputs_and_flags",
        D + "test_make_corpus_cuts_documents_at_blank_lines_up_to_the_size",
        D + "test_refusals",
    ],
    "--repeats": [D + "test_main_throughputs_and_flags", D + "test_refusals"],
}
C = "test_bench_curves.py::"
CURVES = {
    "--ref": [
        C + "test_main_flags_make_three_runs_per_variant",
        C + "test_main_refusals",
        C + "test_runs_and_table",
    ],
    "--variants": [C + "test_main_flags_make_three_runs_per_variant", C + "test_main_refusals"],
    "--iters": C + "test_main_flags_make_three_runs_per_variant",
    "--out": [C + "test_main_flags_make_three_runs_per_variant", C + "test_runs_and_table"],
    "--data-dir": [C + "test_main_flags_make_three_runs_per_variant", C + "test_runs_and_table"],
    "--set": [
        C + "test_main_flags_make_three_runs_per_variant",
        C + "test_main_refusals",
        C + "test_split_run_halves_the_rows_of_the_batch_it_is_given",
    ],
    "--table": [
        C + "test_main_flags_make_three_runs_per_variant",
        C + "test_table_labels_and_values_are_each_runs_own",
    ],
}
Q = "test_bench_quality.py::"
QUALITY = {
    "--setting": [Q + "test_main_flags_build_the_runs", Q + "test_main_refusals"],
    "--rows": [
        Q + "test_main_flags_build_the_runs",
        Q + "test_main_refusals",
        Q + "test_rerunning_a_command_keeps_the_runs_that_ended",
        Q + "test_doc_mask_rows_are_their_rows_with_the_mask_and_in_no_default",
    ],
    "--seeds": [
        Q + "test_main_flags_build_the_runs",
        Q + "test_main_refusals",
        Q + "test_rerunning_a_command_keeps_the_runs_that_ended",
    ],
    "--out": Q + "test_main_flags_build_the_runs",
    "--data-dir": [Q + "test_main_flags_build_the_runs", Q + "test_run_args_are_train_config_keys"],
    "--parallel": [
        Q + "test_main_flags_build_the_runs",
        Q + "test_main_refusals",
        Q + "test_launch_all_reports_each_finished_run",
    ],
    "--max-seconds": Q + "test_main_flags_build_the_runs",
    "--lr": [Q + "test_main_flags_build_the_runs", Q + "test_run_args_lr_and_probe"],
    "--probe": [
        Q + "test_main_flags_build_the_runs",
        Q + "test_run_args_lr_and_probe",
        Q + "test_probe_records_stage1_of_a_training_run",
    ],
    "--table": [Q + "test_main_flags_build_the_runs", Q + "test_table_of_a_setting_folder_and_of_nothing"],
    "--probe-run": Q + "test_probe_records_stage1_of_a_training_run",
}
S = "test_bench_state_tracking.py::"
STATE_TRACKING = {
    "--tasks": [S + "test_flags_reach_every_run_and_the_results", S + "test_refusals"],
    "--seconds": [S + "test_flags_reach_every_run_and_the_results", S + "test_refusals"],
    "--deadline": [
        S + "test_flags_reach_every_run_and_the_results",
        S + "test_refusals",
        "test_state_tracking.py::test_bench_deadline_kills",
    ],
    "--only": [
        S + "test_flags_reach_every_run_and_the_results",
        S + "test_refusals",
        "test_state_tracking.py::test_bench_configs",
    ],
    "--extra": S + "test_flags_reach_every_run_and_the_results",
    "--out": S + "test_flags_reach_every_run_and_the_results",
    "--work": S + "test_flags_reach_every_run_and_the_results",
    "--check-timeout": [
        S + "test_check_timeout_and_the_triton_verdict",
        S + "test_check_triton_reads_its_subprocess",
    ],
}
COMPILE_CHECK = {
    "--mix": [
        "test_compile_check.py::test_main_compiles_every_launch_and_mix_only_the_u_stage",
        "test_compile_check.py::test_mix_takes_the_bf16_u_stage_shapes",
        "test_compile_check.py::test_mix_counts_a_loop_body_by_class",
    ],
}


def argv_flags(module):
    """The flags a module reads from its argv by hand, not through argparse: the '--' strings of each
    comparison with argv (`"--mix" in sys.argv`, `argv[:1] == ["--probe-run"]`)."""
    out = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.Compare):
            continue
        parts = [n for side in (node.left, *node.comparators) for n in ast.walk(side)]
        if any(getattr(n, "id", None) == "argv" or getattr(n, "attr", None) == "argv" for n in parts):
            out |= {n.value for n in parts if isinstance(n, ast.Constant) and str(n.value).startswith("--")}
    return out


def options(module, *args):
    """Every option of a bench script: its parser's, caught as main() first parses, and its argv's own."""
    return flags(parser_of(module.main, *args)) | argv_flags(module)


SCRIPTS = {  # script -> (its options, its table)
    "bench_train": (lambda: options(bench_train) | argv_flags(common), {**ROWS, **TRAIN}),
    "bench_infer": (lambda: options(bench_infer) | argv_flags(common), {**ROWS, **INFER}),
    "bench_attention": (lambda: options(bench_attention), ATTENTION),
    "bench_ddl": (lambda: options(bench_ddl), DDL),
    "bench_ddp": (lambda: options(bench_ddp), DDP),
    "bench_data": (lambda: options(bench_data), DATA),
    "bench_curves": (lambda: options(bench_curves, []), CURVES),
    "bench_quality": (lambda: options(bench_quality, []), QUALITY),
    "run_state_tracking": (lambda: options(run_state_tracking), STATE_TRACKING),
    "compile_check": (lambda: argv_flags(compile_check), COMPILE_CHECK),  # no argparse: sys.argv alone
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_of_every_bench_script_has_a_test(script):
    found, table = SCRIPTS[script]
    assert missing(table, found()) == []


def test_every_bench_script_has_a_table():
    scripts = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "bench", "*.py"))
               if "\ndef main(" in open(p).read()}  # fmt: skip
    assert scripts == set(SCRIPTS)


def test_the_walk_finds_each_kind_of_option():
    """The walk itself: a parser's options, the hand-read flags, and the row flags of both row scripts."""
    assert argv_flags(common) == {"--job"} and argv_flags(bench_quality) == {"--probe-run"}
    assert argv_flags(compile_check) == {"--mix"} and argv_flags(bench_train) == set()
    rows = flags(common.row_parser("", ["additive"]))
    assert rows == set(ROWS) - {"--job"} and rows < options(bench_train) and rows < options(bench_infer)
    assert missing({"--x": "test_bench_rows.py::test_nothing"}, {"--y"}) == [
        "--y: no test in the table", "--x: in the table but not an option",
        "--x: test_bench_rows.py::test_nothing does not exist",
    ]  # fmt: skip
