"""Every option of train.py (its config keys, GPTConfig's fields among them) and of GPT.forward: a table,
option -> the tests that check what it changes (and what it refuses), walked against the real options;
then the tests of the options that no other test checks. train.py runs in this process
(tests/train_inline.py), so a refusal or a tiny run costs no interpreter start."""

import dataclasses
import json
import os
import sys
import types

import pytest
import torch
from option_coverage import missing, parameters
from train_inline import REPO, TINY, run_train, write_shards

import model as model_module
from model import GPT, GPTConfig, RMSNorm, SoftmaxAttention

T = "test_train.py::"
M = "test_model.py::"
O = "test_options_train.py::"
N = "test_train_numbers.py::"
I = "test_init_dropout.py::"
D = "test_doc_mask.py::"

# train.py's own keys (the GPTConfig fields, keys too, are in MODEL_FIELDS)
TRAIN_KEYS = {
    "out_dir": [
        T + "test_tiny_run_learns_logs_and_checkpoints",
        T + "test_out_dir_that_is_a_file_is_one_line",
    ],
    "init_from": [T + "test_resume_is_bit_exact", O + "test_choices_refuse_what_is_not_listed"],
    "overwrite": T + "test_fresh_run_refuses_a_previous_run_and_overwrite_replaces_it",
    "eval_interval": [T + "test_tiny_run_learns_logs_and_checkpoints", O + "test_lower_bounds"],
    "eval_iters": [N + "test_logged_losses_and_adam_moments_recomputed", O + "test_lower_bounds"],
    "log_interval": [N + "test_throughput_eta_and_max_seconds_under_a_fake_clock", O + "test_lower_bounds"],
    "wandb_log": [O + "test_wandb_gets_the_project_the_run_name_and_every_record", T + "test_wandb_offline"],
    "wandb_project": O + "test_wandb_gets_the_project_the_run_name_and_every_record",
    "wandb_run_name": O + "test_wandb_gets_the_project_the_run_name_and_every_record",
    "dataset": [
        O + "test_dataset_and_data_dir_choose_the_shards",
        O + "test_choices_refuse_what_is_not_listed",
    ],
    "data_dir": O + "test_dataset_and_data_dir_choose_the_shards",
    "batch_size": [
        T + "test_accumulated_gradients_equal_one_step_over_the_global_batch",
        O + "test_lower_bounds",
    ],
    "gradient_accumulation_steps": [
        T + "test_accumulated_gradients_equal_one_step_over_the_global_batch",
        T + "test_gradient_accumulation_must_divide_among_ranks",
        O + "test_lower_bounds",
    ],
    "st_task": O + "test_state_tracking_keys_make_the_batches",
    "st_n": O + "test_state_tracking_keys_make_the_batches",
    "st_n_nodes": O + "test_state_tracking_keys_make_the_batches",
    "st_length": [O + "test_state_tracking_keys_make_the_batches", O + "test_lower_bounds"],
    "st_curriculum": O + "test_state_tracking_keys_make_the_batches",
    "st_curriculum_acc": O + "test_state_tracking_keys_make_the_batches",
    "st_max_length": O + "test_state_tracking_keys_make_the_batches",
    "st_eval_lengths": O + "test_state_tracking_keys_make_the_batches",
    "learning_rate": [
        T + "test_tiny_run_learns_logs_and_checkpoints",
        O + "test_run_checks_refuse_bad_values",
    ],
    "min_lr": [T + "test_lr_is_min_lr_from_lr_decay_iters_on", O + "test_run_checks_refuse_bad_values"],
    "warmup_iters": [T + "test_lr_is_min_lr_from_lr_decay_iters_on", O + "test_lower_bounds"],
    "lr_decay_iters": [T + "test_lr_is_min_lr_from_lr_decay_iters_on", O + "test_lower_bounds"],
    "max_iters": [T + "test_max_iters_0_checkpoints_the_initial_model_it_names", O + "test_lower_bounds"],
    "max_seconds": [N + "test_throughput_eta_and_max_seconds_under_a_fake_clock", O + "test_lower_bounds"],
    "weight_decay": [
        T + "test_the_optimizer_gets_the_clipped_gradient_and_decays_only_matrices",
        O + "test_lower_bounds",
    ],
    "betas": [N + "test_logged_losses_and_adam_moments_recomputed", O + "test_run_checks_refuse_bad_values"],
    "grad_clip": [
        T + "test_the_optimizer_gets_the_clipped_gradient_and_decays_only_matrices",
        T + "test_accumulated_gradients_equal_one_step_over_the_global_batch",  # 0: off
        O + "test_lower_bounds",
    ],
    "seed": [
        N + "test_logged_losses_and_adam_moments_recomputed",
        O + "test_lower_bounds",
        O + "test_run_checks_refuse_bad_values",
    ],
    "device": O + "test_run_checks_refuse_bad_values",
    "dtype": [
        O + "test_dtype_sets_the_autocast_of_every_forward",
        O + "test_choices_refuse_what_is_not_listed",
    ],
    "compile": O + "test_compile_and_ddp_split_graph",
    "ddp_split_graph": O + "test_compile_and_ddp_split_graph",
    "dry_run": [
        T + "test_config_files_are_valid_for_train_py",
        T + "test_missing_val_shards_hint_once_and_dry_run_shows_resolved_values",
    ],
}

# every GPTConfig field: what it changes in the model (and that train.py hands it to the model)
PASSED = O + "test_every_model_field_reaches_the_model"
BOUNDS = O + "test_gptconfig_bounds"
MODEL_FIELDS = {
    "n_layer": [M + "test_preset_param_counts", O + "test_size_fields_shape_the_model", BOUNDS],
    "n_head": [
        M + "test_flops_per_token_against_counted_matmuls",
        O + "test_size_fields_shape_the_model",
        BOUNDS,
    ],
    "n_embd": [M + "test_preset_param_counts", O + "test_size_fields_shape_the_model", BOUNDS],
    "head_dim": [
        "test_attention.py::test_attention_matches_the_formula",
        O + "test_size_fields_shape_the_model",
    ],
    "block_size": [
        M + "test_bad_inputs_raise",
        T + "test_resume_takes_block_size_from_the_checkpoint",
        O + "test_size_fields_shape_the_model",
        BOUNDS,
    ],
    "vocab_size": [
        M + "test_forward_loss_shapes_and_ignore_index",
        T + "test_token_ids_beyond_vocab_size_name_the_shard",
    ],
    "mlp_hidden": [O + "test_size_fields_shape_the_model", BOUNDS],
    "rope_base": [O + "test_rope_base_and_norm_eps_in_attention", BOUNDS],
    "norm_eps": [O + "test_rope_base_and_norm_eps_in_attention", O + "test_norm_eps_is_every_norms", BOUNDS],
    "init": [I + "test_init_stds_follow_the_docstring", "test_parity.py::test_init_matches_authors"],
    "dropout": [
        M + "test_dropout_only_in_training",
        I + "test_dropout_on_the_sublayer_output_not_its_input",
        I + "test_dropout_on_the_embedding",
        I + "test_dropout_on_the_attention_weights",
        T + "test_resume_takes_dropout_and_backend_from_this_run",
        BOUNDS,
    ],
    "residual": [M + "test_ddl_sublayer_matches_formula", "test_parity.py::test_logits_match_authors_model"],
    "ddl_dv": [
        O + "test_size_fields_shape_the_model",
        M + "test_kept_states_follow_ddl_keep_state_every",
        BOUNDS,
    ],
    "ddl_ec": M + "test_ec_identity_init_is_repetition",
    "ddl_erase": [M + "test_ddl_sublayer_matches_formula", M + "test_write_only_differs_from_erase"],
    "ddl_beta_init": [I + "test_ddl_beta_init_is_the_initial_beta", BOUNDS],
    "ddl_v": M + "test_ddl_sublayer_matches_formula",
    "ddl_conv_size": [M + "test_ec_perturbed_is_causal_conv", O + "test_size_fields_shape_the_model", BOUNDS],
    "ddl_state_dtype": M + "test_bf16_state_close_to_fp32_state",
    "ddl_state_rounding": "test_ddl.py::test_a_models_updates_round_with_independent_noise",
    "ddl_keep_state_every": [M + "test_kept_states_follow_ddl_keep_state_every", BOUNDS],
    "attention": [
        M + "test_flops_per_token_against_counted_matmuls",
        O + "test_deltaformer_fields_reach_its_op",
    ],
    "deltaformer_w": O + "test_deltaformer_fields_reach_its_op",
    "deltaformer_kernel": O + "test_deltaformer_fields_reach_its_op",
    "deltaformer_beta_max": [O + "test_deltaformer_fields_reach_its_op", BOUNDS],
    "backend": [O + "test_backend_reaches_every_op", M + "test_triton_backend_matches_torch_backend"],
    "doc_mask": [
        D + "test_packed_document_equals_it_alone",
        D + "test_one_document_is_unchanged_by_the_flag",
        D + "test_cached_decoding_across_documents_equals_the_full_forward",
    ],
}
MODEL_FIELDS = {k: [PASSED, *([v] if isinstance(v, str) else v)] for k, v in MODEL_FIELDS.items()}

FORWARD_ARGS = {
    "idx": [M + "test_forward_loss_shapes_and_ignore_index", M + "test_causal", O + "test_forward_refuses"],
    "targets": [M + "test_forward_loss_shapes_and_ignore_index", O + "test_forward_refuses"],
    "attention_mask": [D + "test_left_padded_rows_equal_each_row_alone", D + "test_attention_mask_refusals"],
}

SMALL = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--head_dim=16", "--vocab_size=64", "--block_size=16"]


def dry(*args):
    """A dry run (config checks, the model on the meta device, no data): (status, stdout, stderr, globals)."""
    return run_train("--dry_run=True", "--device=cpu", *SMALL, *args)


def refused(result, message):
    """Whether a run stopped with one line, train.py's error, holding `message`."""
    status, _, err, _ = result
    return status == 1 and err.startswith("train.py: error: ") and message in err and err.count("\n") == 1


def test_the_table_covers_every_option_with_tests_that_exist():
    status, _, err, ns = dry()
    assert status == 0, err
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    keys = set(ns["config"])
    assert fields <= keys  # every GPTConfig field is a key of train.py too
    problems = missing(TRAIN_KEYS, keys - fields) + missing(MODEL_FIELDS, fields)
    problems += missing(FORWARD_ARGS, parameters(GPT.forward))
    assert not problems, "\n".join(problems)


# ---- what train.py refuses: each refusal at its edge, so that a loosened or shifted check fails ----

AT_LEAST = {  # written here, not read from train.py: a bound moved there fails below
    **dict.fromkeys(["batch_size", "block_size", "gradient_accumulation_steps", "eval_interval"], 1),
    **dict.fromkeys(["eval_iters", "log_interval", "st_length"], 1),
    **dict.fromkeys(["max_iters", "warmup_iters", "lr_decay_iters", "seed"], 0),
    **dict.fromkeys(["weight_decay", "grad_clip", "max_seconds"], 0.0),
}


def test_lower_bounds():
    assert set(dry()[3]["AT_LEAST"]) == set(AT_LEAST)
    for key, low in AT_LEAST.items():
        below = low - 1 if isinstance(low, int) else low - 1e-9
        assert refused(dry(f"--{key}={below!r}"), f"{key} must be >= {low:g}, got {below}"), key
        status, _, err, ns = dry(f"--{key}={low!r}")
        assert status == 0 and ns["config"][key] == low, (key, err)


def test_choices_refuse_what_is_not_listed(tmp_path):
    datasets = ("shakespeare", "fineweb_edu", "state_tracking")
    choices = {"init_from": ("scratch", "resume"), "dataset": datasets, "dtype": ("float32", "bfloat16")}
    assert dry()[3]["CHOICES"].keys() == choices.keys()
    for key, allowed in choices.items():
        for value in allowed:  # taken (a dry resume then wants a checkpoint: not the choice's refusal)
            assert "must be one of" not in dry(f"--{key}={value}", f"--out_dir={tmp_path}")[2], (key, value)
        listed = ", ".join(allowed)
        assert refused(dry(f"--{key}={allowed[0]}x"), f"{key} must be one of {listed}; got '{allowed[0]}x'")


def wrong_type(default):
    """A literal of another type than `default`'s, or None where every literal is taken (str keys take
    any text; a None default, any literal, which GPTConfig then checks)."""
    if isinstance(default, bool):
        return "1"
    if isinstance(default, int):
        return "1.5"
    if isinstance(default, float):
        return "True"
    if isinstance(default, tuple):
        return repr(default[:-1])
    return "1.5" if default is None else None


def test_every_key_refuses_a_value_of_another_type():
    defaults = dry()[3]["_defaults"]
    for key, default in defaults.items():
        value = wrong_type(default)
        if value is None:
            continue
        message = f"key '{key}' expects" if default is not None else f"GPTConfig.{key} must be"
        assert refused(dry(f"--{key}={value}"), message), key
    assert refused(
        dry("--learnig_rate=1e-3"), "unknown config key 'learnig_rate'. Did you mean learning_rate"
    )
    for key in model_module.CHOICES:  # a GPTConfig string field: one of its values
        assert refused(dry(f"--{key}=nope"), f"GPTConfig.{key} must be one of"), key


def test_run_checks_refuse_bad_values():
    lr = "--learning_rate=1e-3"
    for ok in (["--min_lr=0.0"], ["--min_lr=1e-3", lr], ["--betas=(0.0, 0.999)"], ["--seed=4294901760"]):
        assert dry(*ok)[0] == 0, ok
    assert refused(dry("--min_lr=-1e-9"), "need 0 <= min_lr <= learning_rate, got min_lr=-1e-09")
    assert refused(dry("--min_lr=0.0010000001", lr), "need 0 <= min_lr <= learning_rate")
    assert refused(dry("--betas=(0.9, 1.0)"), "betas must each be in [0, 1) (AdamW), got (0.9, 1.0)")
    assert refused(dry("--betas=(-0.1, 0.9)"), "betas must each be in [0, 1)")
    assert refused(dry("--seed=4294901761"), "seed must be <= 2**32 - 2**16, got 4294901761")
    assert refused(dry("--device=tpu"), "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'")
    if not torch.cuda.is_available():
        assert refused(
            run_train("--dry_run=True", "--device=cuda"), "CUDA is not available (use --device=cpu)"
        )
    assert refused(dry("--n_layer=0"), "model config: GPTConfig.n_layer must be a positive int, got 0")


# ---- GPTConfig: train.py hands every field to the model; each field's bounds and effect ----

NON_DEFAULT = dict(
    n_layer=3, n_head=3, n_embd=48, head_dim=8, block_size=40, vocab_size=72, mlp_hidden=50, rope_base=500.0,
    norm_eps=1e-3, init="nanogpt", dropout=0.25, residual="ddl-tc", ddl_dv=3, ddl_ec=False, ddl_erase=False,
    ddl_beta_init=0.5, doc_mask=True, ddl_v="linear", ddl_conv_size=3, ddl_state_dtype="bfloat16",
    ddl_state_rounding="stochastic", ddl_keep_state_every=2, attention="deltaformer", deltaformer_w="proj",
    deltaformer_kernel="relu", deltaformer_beta_max=1.5, backend="torch",
)  # fmt: skip


def test_every_model_field_reaches_the_model():
    defaults = GPTConfig()
    assert set(NON_DEFAULT) == {f.name for f in dataclasses.fields(GPTConfig)}
    assert all(getattr(defaults, k) != v for k, v in NON_DEFAULT.items())
    status, out, err, ns = dry(*(f"--{k}={v}" for k, v in NON_DEFAULT.items()))
    assert status == 0, err
    assert ns["model_args"] == NON_DEFAULT and ns["meta_model"].config == GPTConfig(**NON_DEFAULT)
    for k, v in NON_DEFAULT.items():
        assert f"  {k} = {v!r}\n" in out, k


BASE = dict(n_layer=1, n_head=1, n_embd=8, head_dim=8, block_size=8, vocab_size=8, residual="ddl-cc")
EDGES = [  # (field, the last value taken, the first refused) on either side of each bound
    *[(f, 1, 0) for f in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "ddl_conv_size")],
    ("head_dim", 2, 0), ("head_dim", 4, 3), ("mlp_hidden", 1, 0), ("ddl_dv", 1, 0),
    ("dropout", 0.0, -1e-9), ("dropout", 0.999, 1.0), ("rope_base", 1e-9, 0.0), ("norm_eps", 1e-12, 0.0),
    ("deltaformer_beta_max", 1e-9, 0.0), ("ddl_beta_init", 1e-9, 0.0), ("ddl_beta_init", 2 - 1e-9, 2.0),
    ("ddl_keep_state_every", 0, -1),
]  # fmt: skip


def test_gptconfig_bounds():
    for field, taken, past in EDGES:
        assert getattr(GPTConfig(**{**BASE, field: taken}), field) == taken
        with pytest.raises(ValueError, match=f"GPTConfig.{field} must be"):
            GPTConfig(**{**BASE, field: past})


def test_size_fields_shape_the_model():
    cfg = GPTConfig(
        n_layer=3, n_head=3, head_dim=8, n_embd=20, vocab_size=37, block_size=12, mlp_hidden=11,
        residual="ddl-tc", ddl_dv=3, ddl_conv_size=5, backend="torch",
    )  # fmt: skip
    m = GPT(cfg)
    assert len(m.blocks) == 3 and m.wte.weight.shape == (37, 20)
    attn, mlp, res = m.blocks[0].attn, m.blocks[0].mlp, m.blocks[0].res_attn
    assert attn.c_attn.weight.shape == (3 * 3 * 8, 20) and attn.c_proj.weight.shape == (20, 3 * 8)
    assert attn.q_norm.weight.shape == (8,)
    assert mlp.c_fc.weight.shape == (2 * 11, 20) and mlp.c_proj.weight.shape == (20, 11)
    assert res.v_proj.weight.shape == (3, 20) and m.blocks[0].compress.conv.shape == (20, 3, 5)
    assert m.ec_conv.shape == (20, 3, 5)
    idx = torch.randint(0, 37, (2, 12))
    assert m.embed(idx).shape == (2, 12, 20, 3)  # X0: d_v copies (EC) of each embedding
    assert m(idx, idx)[0].shape == (2, 12, 37)
    with pytest.raises(ValueError, match="exceeds block_size 12"):
        m(torch.randint(0, 37, (1, 13)))
    default_hidden = GPT(dataclasses.replace(cfg, mlp_hidden=None)).blocks[0].mlp
    assert default_hidden.c_proj.weight.shape == (20, 8 * 20 // 3)


@torch.no_grad()
def test_rope_base_and_norm_eps_in_attention():
    from test_attention import reference

    cfg = GPTConfig(n_layer=1, n_head=2, head_dim=8, n_embd=16, block_size=32, vocab_size=64)
    c = torch.randn(2, 12, 16, dtype=torch.float64)
    other = dataclasses.replace(cfg, rope_base=37.0, norm_eps=0.3)
    attn = SoftmaxAttention(other, torch.nn.Module()).double()
    default = SoftmaxAttention(cfg, torch.nn.Module()).double()
    default.load_state_dict(attn.state_dict())
    torch.testing.assert_close(attn(c, pos=3), reference(attn, c, 3), rtol=1e-10, atol=1e-12)
    assert (attn(c, pos=3) - default(c, pos=3)).abs().max() > 1e-3  # the two fields change the output


@torch.no_grad()
def test_norm_eps_is_every_norms():
    cfg = GPTConfig(n_layer=2, n_head=2, head_dim=8, n_embd=16, block_size=8, vocab_size=64, norm_eps=0.5)
    for residual in ("additive", "ddl", "ddl-cc"):
        for attention in ("softmax", "deltaformer"):
            m = GPT(dataclasses.replace(cfg, residual=residual, attention=attention, deltaformer_w="proj"))
            norms = [mod for mod in m.modules() if isinstance(mod, RMSNorm)]
            # per block the two sublayers' norms and q's, k's (and w's) norms; the final norm
            assert len(norms) == 2 * 2 + 2 * (3 if attention == "deltaformer" else 2) + 1
            assert all(n.eps == 0.5 for n in norms)
    x = torch.randn(3, 16, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.5)
    torch.testing.assert_close(m.ln_f.double()(x), want, rtol=1e-12, atol=1e-12)


def test_backend_reaches_every_op(monkeypatch):
    import ops.ddl
    import ops.ddl.stream
    import ops.deltaformer

    seen = []

    def spy(fn, backend, *tensors):
        seen.append((fn, backend))
        return "torch"  # the reference path: what matters here is the backend asked for

    for module in (ops.ddl, ops.ddl.stream, ops.deltaformer):
        monkeypatch.setattr(module, "resolve_backend", spy)
    for backend in ("torch", "triton"):
        for residual in ("ddl", "ddl-cc", "ddl-tc"):
            seen.clear()
            cfg = GPTConfig(
                n_layer=1, n_head=2, head_dim=8, n_embd=16, block_size=8, vocab_size=64, residual=residual,
                attention="deltaformer", backend=backend,
            )  # fmt: skip
            idx = torch.randint(0, 64, (2, 8))
            GPT(cfg)(idx, idx)[1].backward()
            ops_called = {fn for fn, _ in seen}
            assert "deltaformer_attention" in ops_called and any(
                f.startswith("ddl_update") for f in ops_called
            )
            if residual == "ddl-tc":
                assert "expand_ec" in ops_called
            assert {b for _, b in seen} == {backend}, (residual, seen)


def test_deltaformer_fields_reach_its_op(monkeypatch):
    seen, inputs = [], []
    op = model_module.deltaformer_attention

    def spy(q, k, v, w, beta, kernel="softmax", scale=None, backend="auto"):
        seen.append(dict(q=q, k=k, w=w, beta=beta, kernel=kernel))
        return op(q, k, v, w, beta, kernel=kernel, scale=scale, backend=backend)

    monkeypatch.setattr(model_module, "deltaformer_attention", spy)
    base = GPTConfig(n_layer=1, n_head=2, head_dim=8, n_embd=16, block_size=8, vocab_size=64)
    idx = torch.randint(0, 64, (2, 8))
    softmax = GPT(base)
    softmax(idx)
    assert seen == []  # attention="softmax" does not run Deltaformer's op
    for w, kernel, beta_max in (("k", "relu", 1.7), ("q", "linear", 0.3), ("proj", "softmax", 1.0)):
        cfg = dataclasses.replace(
            base,
            attention="deltaformer",
            deltaformer_w=w,
            deltaformer_kernel=kernel,
            deltaformer_beta_max=beta_max,
        )
        m = GPT(cfg)
        hook = m.blocks[0].attn.register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
        seen.clear()
        with torch.no_grad():
            m(idx)
        hook.remove()
        (call,) = seen
        assert call["kernel"] == kernel
        if w == "proj":  # its own projection: a fourth slice of c_attn, neither q nor k
            assert m.blocks[0].attn.c_attn.weight.shape[0] == 4 * 16
            assert not torch.equal(call["w"], call["k"]) and not torch.equal(call["w"], call["q"])
        else:
            assert call["w"] is call[w]
        gate = m.blocks[0].attn.beta
        want = beta_max * torch.sigmoid(inputs[-1] @ gate.weight.T + gate.bias).transpose(1, 2)
        torch.testing.assert_close(call["beta"], want, rtol=1e-6, atol=1e-7)


def test_forward_refuses():
    m = GPT(GPTConfig(n_layer=1, n_head=2, head_dim=8, n_embd=16, block_size=8, vocab_size=64))
    idx = torch.randint(0, 64, (2, 5))
    for bad in (idx[0], idx[None], idx.int(), idx.float()):
        with pytest.raises(ValueError, match=r"idx must be int64 \[B, T\], got"):
            m(bad)
    for bad in (idx[:, :4], idx[0], idx.int(), idx.float()):
        with pytest.raises(ValueError, match=r"targets must be int64 \(2, 5\), got"):
            m(idx, bad)
    logits, loss = m(idx)
    assert logits.shape == (2, 1, 64) and loss is None  # no targets: the last position only


# ---- train.py's keys that only a run shows ----


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("data"))


def test_compile_and_ddp_split_graph(tmp_path, data_dir, monkeypatch):
    # torch.compile stands in for itself: a module that counts its calls (compiling is not what is tested)
    class Compiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.calls = model, 0

        def forward(self, *args):
            self.calls += 1
            return self.model(*args)

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model: compiled.append(Compiled(model)) or compiled[-1])
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", torch._dynamo.config.optimize_ddp)  # restored
    for n, (flag, split) in enumerate(((True, True), (True, False), (False, True))):
        args = [
            f"--compile={flag}",
            f"--ddp_split_graph={split}",
            "--max_iters=1",
            f"--out_dir={tmp_path / str(n)}",
        ]
        status, _, err, ns = run_train(*TINY, f"--data_dir={data_dir}", *args)
        assert status == 0, err
        if flag:
            assert compiled[-1].model is ns["raw_model"] and torch._dynamo.config.optimize_ddp is split
            assert compiled[-1].calls == 2 * 2 * 2 + 2  # 2 evaluations of 2 x 2 micro-batches, 1 step of 2
    assert len(compiled) == 2 and torch._dynamo.config.optimize_ddp is False  # compile=False: untouched


def test_dtype_sets_the_autocast_of_every_forward(tmp_path, data_dir, monkeypatch):
    seen = []
    forward = GPT.forward

    def spy(self, idx, targets=None):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return forward(self, idx, targets)

    monkeypatch.setattr(GPT, "forward", spy)
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", None)):
        seen.clear()
        out = f"--out_dir={tmp_path / dtype}"
        status, _, err, _ = run_train(
            *TINY, f"--data_dir={data_dir}", f"--dtype={dtype}", "--max_iters=1", out
        )
        assert status == 0, err
        assert seen == [want] * 10, (dtype, seen)  # 2 evaluations of 2 x 2 micro-batches, 1 step of 2


def test_wandb_gets_the_project_the_run_name_and_every_record(tmp_path, data_dir, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs))
    fake.log = lambda record, step: calls.append(("log", record, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    common = [*TINY, f"--data_dir={data_dir}", "--max_iters=2", "--eval_interval=2"]
    assert run_train(*common, f"--out_dir={tmp_path / 'off'}")[0] == 0
    assert calls == []  # wandb_log=False
    wandb = ["--wandb_log=True", "--wandb_project=proj", "--wandb_run_name=name"]
    status, _, err, ns = run_train(*common, *wandb, f"--out_dir={tmp_path / 'on'}")
    assert status == 0, err
    assert calls[0] == ("init", dict(project="proj", name="name", config=ns["config"])) and calls[-1] == (
        "finish",
    )
    with open(tmp_path / "on" / "log.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert calls[1:-1] == [("log", {k: v for k, v in r.items() if k != "iter"}, r["iter"]) for r in records]


def test_dataset_and_data_dir_choose_the_shards(tmp_path, monkeypatch):
    import data.loader

    asked = []

    def shard_loaders(directory, *args):
        asked.append(directory)
        raise FileNotFoundError(f"no 'train' shards in {directory}")

    monkeypatch.setattr(data.loader, "shard_loaders", shard_loaders)
    out = f"--out_dir={tmp_path / 'out'}"
    for dataset in ("shakespeare", "fineweb_edu"):
        result = run_train(*TINY, f"--dataset={dataset}", out)
        assert asked[-1] == os.path.join(REPO, "data", dataset)
        assert result[0] == 1 and f"{dataset=}: prepare it first with `python data/{dataset}.py`" in result[2]
    run_train(*TINY, "--dataset=fineweb_edu", f"--data_dir={tmp_path}", out)
    assert asked[-1] == str(tmp_path)


def test_state_tracking_keys_make_the_batches(tmp_path, monkeypatch):
    from data.state_tracking import StateTrackingLoader

    batches = []
    forward = GPT.forward

    def spy(self, idx, targets=None):
        if self.training:
            batches.append((idx, targets))
        return forward(self, idx, targets)

    monkeypatch.setattr(GPT, "forward", spy)
    common = [
        "--dataset=state_tracking",
        "--block_size=40",
        "--gradient_accumulation_steps=1",
        "--max_iters=1",
    ]
    common += ["--eval_interval=1", "--eval_iters=1", "--seed=3", "--st_max_length=12"]
    swap = ["--st_n=3", "--st_length=8", "--st_curriculum=True"]
    runs = [  # (keys, the task, the length iteration 0 trains at, the evaluation lengths at the end)
        ([*swap, "--st_curriculum_acc=0.0"], ("swap", 3), 12, (12, 20)),  # doubled at
        # the evaluation at 0, capped at st_max_length
        ([*swap, "--st_curriculum_acc=1.01"], ("swap", 3), 8, (10, 24)),  # an accuracy never reached
        (["--st_task=dag", "--st_n_nodes=8", "--st_length=14", "--st_curriculum_acc=0.0",
          "--st_max_length=28"], ("dag", 8), 14, (16, 20)),  # st_curriculum=False: 14, not 28
    ]  # fmt: skip
    for n, (keys, (task, size), length, lengths) in enumerate(runs):
        batches.clear()
        args = [*TINY, *common, *keys, f"--st_eval_lengths={lengths}", f"--out_dir={tmp_path / str(n)}"]
        status, _, err, _ = run_train(*args)
        assert status == 0, err
        sizes = {"n": size} if task == "swap" else {"n_nodes": size}
        (x, y), (want_x, want_y) = (
            batches[0],
            StateTrackingLoader(task, "train", length, 3, **sizes).get_batch(0, 0, 4, 4),
        )
        assert torch.equal(x, want_x) and torch.equal(y, want_y), n
        with open(tmp_path / str(n) / "log.jsonl") as f:
            final = [json.loads(line) for line in f if '"final": true' in line]
        assert len(final) == 1 and {f"val_acc@{k}" for k in lengths} <= set(final[0]), (n, final)
