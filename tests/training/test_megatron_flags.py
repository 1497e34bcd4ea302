"""Megatron-LM's `pretrain_gpt.py` flags in `teratron train` (teratron.training.megatron_flags):
every flag of Megatron's parser (megatron_flags.json, read from a Megatron-LM checkout by
extract_megatron_flags.py) is honoured, accepted with a start-up note, or refused with one line;
realistic GPT-2 and Llama command lines from Megatron's examples parse, build the run and (GPT-2)
train; Megatron's resume rule for the learning-rate schedule."""

import json
import math
import os
import shutil

import pytest
import torch

from teratron import cli
from teratron.dist_checkpointing import storage
from teratron.tokenizers.gpt2_bpe import default_gpt2_files
from teratron.training import megatron_flags
from teratron.training.arguments import build_train_parser, parse_train_args
from teratron.training.build import build_scheduler
from teratron.training.config import run_config_from_args
from teratron.transformer.mlp import openai_gelu

TRAINING = ["--mock-data", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]
BASE = TRAINING + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
MEGATRON = json.load(open(os.path.join(os.path.dirname(__file__), "megatron_flags.json")))
MEGATRON_CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "dist_checkpointing", "fixtures", "megatron_core",
                                   "tp1")

# Flags that read --load's checkpoint: walked with a Megatron-LM checkpoint's architecture instead of BASE's.
_FROM_CHECKPOINT = {"--use-checkpoint-args": [], "--use-mp-args-from-checkpoint-args": ["--use-checkpoint-args"]}

# A value of Megatron's own argument types that teratron's parser takes.
_TYPED_VALUES = {"tuple_type": "4,0", "moe_freq_type": "2", "no_rope_freq_type": "2", "la_freq_type": "2",
                 "_parse_cuda_graph_modules_arg": "attn", "bool": "true", "int": "2", "float": "0.5"}


def _values_to_try(record) -> list:
    """Argument lists for one Megatron flag: none for a switch, each choice, else one plausible value."""
    if record["nargs"] == 0:
        return [[]]
    if record["choices"]:
        return [[str(c)] for c in record["choices"]]
    default = record["default"]
    if isinstance(default, (int, float, str)) and not isinstance(default, bool) and default != "":
        value = str(default)
    else:
        value = _TYPED_VALUES.get(record["type"], "x")
    return [[value] * (record["nargs"] if isinstance(record["nargs"], int) else 1)]


def _base(flag: str) -> list:
    if flag not in _FROM_CHECKPOINT:
        return BASE
    return TRAINING + ["--load", MEGATRON_CHECKPOINT, *_FROM_CHECKPOINT[flag]]


def _parse(argv):
    """('parsed', args) or ('refused', the one-line message)."""
    try:
        return "parsed", parse_train_args(argv)
    except (ValueError, NotImplementedError) as e:
        return "refused", str(e)


def _own_options() -> dict:
    """teratron's own flags (not the Megatron-only ones the table adds) -> their actions."""
    return {option: action for option, action in build_train_parser()._option_string_actions.items()
            if not isinstance(action, megatron_flags.MegatronFlagAction)}


def test_megatron_lm_commit_is_recorded():
    assert len(MEGATRON["megatron_lm_commit"]) == 40 and len(MEGATRON["flags"]) > 800


def test_every_megatron_flag_is_honoured_accepted_or_refused():
    """Each spelling of each Megatron flag, with each of its choices (or a plausible value): the
    parser knows it, and it is honoured (teratron's own flag, no note), accepted (a start-up note
    naming it) or refused (one line naming it and the missing feature)."""
    own = _own_options()
    seen = {"honoured": set(), "accepted": set(), "refused": set()}
    for record in MEGATRON["flags"]:
        for flag in record["flags"]:
            for values in _values_to_try(record):
                shown = " ".join([flag, *values])
                outcome, result = _parse(_base(flag) + [flag, *values])
                assert "unrecognized arguments" not in str(result), shown
                value = None if record["nargs"] == 0 else values if record["nargs"] in ("+", "*") else values[0]
                rule = megatron_flags.classify(flag, value)
                if isinstance(rule, megatron_flags.Refused):
                    assert (outcome, result) == ("refused", f"{shown}: {rule.feature} is not supported by teratron; "
                                                            f"{rule.fix}"), shown
                    seen["refused"].add(flag)
                elif rule is not None:
                    assert outcome == "parsed", (shown, result)
                    notes = megatron_flags.startup_notes(result.megatron_flags)
                    assert notes == [f"NOTE: {shown}: accepted; {rule}"], shown
                    seen["accepted"].add(flag)
                elif own[flag].choices is not None and values[0] not in own[flag].choices:
                    # A Megatron value teratron's choices lack: argparse's one line names the flag and value.
                    assert outcome == "refused" and "\n" not in result, (shown, result)
                    assert result.startswith(f"argument {flag}: invalid choice: '{values[0]}' (choose from "), result
                    seen["refused"].add(flag)
                else:
                    assert outcome == "parsed", (shown, result)
                    assert result.megatron_flags == (), shown
                    seen["honoured"].add(flag)
    # Megatron's parser has 838 flags; about a third are teratron's own.
    assert len(seen["honoured"]) > 230 and len(seen["accepted"]) > 150 and len(seen["refused"]) > 300, \
        {k: len(v) for k, v in seen.items()}


def test_examples_of_each_kind():
    """Literal outcomes for flags of Megatron's example scripts."""
    outcome, args = _parse(BASE + ["--transformer-impl", "local", "--no-masked-softmax-fusion",
                                   "--no-persist-layer-norm", "--ckpt-format", "torch_dist",
                                   "--no-gradient-accumulation-fusion", "--distributed-backend", "nccl"])
    assert outcome == "parsed" and not args.gradient_accumulation_fusion and args.distributed_backend == "nccl"
    assert [line.split(": accepted;")[0] for line in megatron_flags.startup_notes(args.megatron_flags)] == [
        "NOTE: --transformer-impl local", "NOTE: --no-masked-softmax-fusion", "NOTE: --no-persist-layer-norm",
        "NOTE: --ckpt-format torch_dist"]
    cases = {
        ("--ckpt-format", "torch"): "--ckpt-format torch: Megatron's legacy torch format (one file per "
                                    "model-parallel rank) is not supported by teratron; use --ckpt-format torch_dist "
                                    "(Megatron-LM's sharded layout) or teratron's own (the default)",
        ("--ckpt-format", "zarr"): "--ckpt-format zarr: this checkpoint format is not supported by teratron; use "
                                   "--ckpt-format torch_dist",
        ("--transformer-impl", "inference_optimized"): "--transformer-impl inference_optimized: Megatron's "
                                                       "inference-optimized layers is not supported by teratron; "
                                                       "use --transformer-impl local",
        ("--tp-comm-overlap",): "--tp-comm-overlap: TP communication/GEMM overlap (Transformer Engine userbuffers) "
                                "is not supported by teratron; drop it; TP collectives run after their GEMMs",
        ("--exit-duration-in-mins", "60"): "--exit-duration-in-mins 60: a wall-clock limit on training is not "
                                           "supported by teratron; use --exit-interval, or --exit-signal-handler "
                                           "with your scheduler's SIGTERM",
        ("--position-embedding-type", "mrope"): "argument --position-embedding-type: invalid choice: 'mrope' "
                                                "(choose from 'learned_absolute', 'rope', 'yarn', 'none')",
    }
    for argv, message in cases.items():
        assert _parse(BASE + list(argv)) == ("refused", message)
    # Megatron's older spellings that teratron honours.
    args = parse_train_args(BASE + ["--recompute-activations", "--use-rotary-position-embeddings",
                                    "--apply-layernorm-1p", "--encoder-seq-length", "64"])
    assert (args.recompute_granularity, args.position_embedding_type, args.layernorm_zero_centered_gamma,
            args.seq_length) == ("selective", "rope", True, 64)
    with pytest.raises(ValueError, match="--no-position-embedding is Megatron's deprecated flag and needs "
                                         "--position-embedding-type rope"):
        run_config_from_args(parse_train_args(BASE + ["--no-position-embedding"]), 1, 64, cuda=False)


def test_megatron_flags_teratron_honours_reach_the_run():
    """The Megatron flags added to teratron's own parser set their fields (and the aliases theirs)."""
    argv = BASE + [
        "--fp32-residual-connection", "--apply-residual-connection-post-layernorm", "--apply-layernorm-1p",
        "--embedding-init-method-std", "0.05", "--no-initialization", "--use-cpu-initialization",
        "--padded-vocab-size", "96", "--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm",
        "--mid-level-dataset-surplus", "0.01", "--muon-nesterov", "--disable-fp8-wgrad", "--save", "ckpt",
        "--persistent-save-interval", "5", "--exit-on-missing-checkpoint", "--loss-scale-window", "500.0",
        "--position-embedding-type", "rope", "--no-position-embedding", "--num-experts", "2",
        "--moe-layer-recompute", "--openai-gelu"]
    with pytest.warns(UserWarning, match="moe_layer_recompute is deprecated"):  # as in Megatron
        run = run_config_from_args(parse_train_args(argv), 1, 64, cuda=False)
    t = run.transformer
    assert t.fp32_residual_connection and t.apply_residual_connection_post_layernorm
    assert t.layernorm_zero_centered_gamma and t.embedding_init_method_std == 0.05
    assert not t.perform_initialization and t.use_cpu_initialization and not t.fp8_wgrad
    assert t.recompute_granularity == "selective" and "moe" in t.recompute_modules  # --moe-layer-recompute
    assert t.activation_func is openai_gelu and not t.gated_linear_unit
    assert run.model.padded_vocab_size == 96 and run.optimizer.apply_wd_to_qk_layernorm
    assert run.optimizer.muon_nesterov and run.optimizer.loss_scale_window == 500.0
    assert run.data.mid_level_dataset_surplus == 0.01 and run.checkpoint.save_interval == 5
    assert run.checkpoint.exit_on_missing_checkpoint and run.megatron_flags == ()
    default = run_config_from_args(parse_train_args(BASE), 1, 64, cuda=False)
    assert default.checkpoint.ckpt_format == "teratron" and default.data.mid_level_dataset_surplus == 0.005
    assert default.transformer.perform_initialization and not default.optimizer.apply_wd_to_qk_layernorm

    with pytest.raises(ValueError, match=r"^--padded-vocab-size \(97\) must be a multiple of "
                                         r"--tensor-model-parallel-size \(2\)"):
        run_config_from_args(parse_train_args(BASE + ["--padded-vocab-size", "97",
                                                      "--tensor-model-parallel-size", "2"]), 2, 64, cuda=False)
    with pytest.raises(ValueError, match="^--num-distributed-optimizer-instances must be 1"):
        run_config_from_args(parse_train_args(BASE + ["--num-distributed-optimizer-instances", "2"]), 1, 64,
                             cuda=False)


def test_the_dataset_surplus_reaches_the_blend(tmp_path):
    from teratron.tokenizers import NullTokenizer
    from teratron.training.data import build_datasets

    run = run_config_from_args(parse_train_args(BASE + ["--mid-level-dataset-surplus", "0.25", "--num-workers", "0",
                                                        "--data-cache-path", str(tmp_path)]), 1, 64, cuda=False)
    train, _, _ = build_datasets(run, NullTokenizer(64))
    assert train.config.mid_level_dataset_surplus == 0.25


def test_yaml_config_takes_megatron_flags(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("use-mcore-models: true\nno-persist-layer-norm: false\ntransformer_impl: local\n")
    args = parse_train_args(BASE + ["--config", str(cfg)])
    assert args.megatron_flags == (("--use-mcore-models", None), ("--transformer-impl", "local"))
    cfg.write_text("fsdp-double-buffer: true\n")
    with pytest.raises(NotImplementedError, match="^--fsdp-double-buffer: tuning of Megatron-FSDP's own buffers"):
        parse_train_args(BASE + ["--config", str(cfg)])


def _gpt2_documents(prefix, vocab=50257):
    import numpy as np

    from teratron.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        for _ in range(3000):  # enough for the 1/1000 test split of --split 949,50,1
            n = int(rng.integers(8, 40))
            builder.add_document(rng.integers(0, vocab, n), [n])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_megatron_gpt2_command_line_trains(tmp_path, capsys):
    """A pretrain_gpt.py command line in the style of Megatron's GPT-3 example (shrunk), with the
    flags users add for a run without Transformer Engine: trains two iterations on the CPU, notes
    each accepted flag once, and with --ckpt-format torch_dist saves Megatron-LM's layout."""
    vocab_file, merge_file = default_gpt2_files()
    save = tmp_path / "ckpt"
    argv = [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--attention-backend", "auto",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--bf16",
        "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "2", "--use-mcore-models", "--transformer-impl", "local", "--no-masked-softmax-fusion",
        "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--use-flash-attn",
        "--data-path", _gpt2_documents(tmp_path / "gpt2_text_document"), "--vocab-file", vocab_file,
        "--merge-file", merge_file, "--tokenizer-type", "GPT2BPETokenizer", "--split", "949,50,1",
        "--data-cache-path", str(tmp_path / "cache"), "--num-workers", "0", "--dataloader-type", "single",
        "--distributed-backend", "nccl", "--log-interval", "1", "--log-throughput", "--save-interval", "2",
        "--eval-interval", "2", "--eval-iters", "1", "--save", str(save), "--load", str(save),
        "--ckpt-format", "torch_dist", "--no-progress-bar",
    ]
    assert cli.main(["train"] + argv) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("NOTE: --")]
    assert [n.split(":")[1].strip() for n in notes] == [
        "--use-mcore-models", "--transformer-impl local", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
        "--use-flash-attn", "--dataloader-type single", "--log-throughput", "--ckpt-format torch_dist"]
    assert sorted(os.listdir(save)) == ["iter_0000002", storage.TRACKER_FILENAME]
    from teratron.dist_checkpointing import megatron_format

    folder = str(save / "iter_0000002")  # Megatron-LM's layout: its metadata.json, the common state in the DCP files
    assert megatron_format.is_megatron_checkpoint(folder)
    common = megatron_format.read_common_state(folder)
    assert common["iteration"] == 2 and common["args"].num_layers == 2
    args = common[megatron_format.TERATRON_RECORD]["run_args"]
    assert args["checkpoint"]["ckpt_format"] == "torch_dist"
    assert ("--transformer-impl", "local") in args["megatron_flags"] or ["--transformer-impl", "local"] in \
        args["megatron_flags"]


def test_megatron_llama_command_line_builds_its_run():
    """The flags of Megatron's Llama 3 8B example (shrunk; TP 2 x CP 2 x DP 2 over 8 processes):
    the run description builds, with its sample-based length and schedule."""
    argv = [
        "--use-mcore-models", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "224",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
        "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "1953125000",
        "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015",
        "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
        "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--tiktoken-pattern", "v2",
        "--split", "99,1,0", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
        "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", "ckpt", "--load", "ckpt",
        "--tensorboard-dir", "tensorboard",
    ]
    run = run_config_from_args(parse_train_args(argv), world_size=8, vocab_size=128256, cuda=True)
    t = run.transformer
    assert (t.tensor_model_parallel_size, t.context_parallel_size, run.distributed.data_parallel_size) == (2, 2, 2)
    assert t.layernorm_zero_centered_gamma and t.num_query_groups == 2 and t.sequence_parallel
    assert run.checkpoint.ckpt_format == "torch_dist" and run.ddp.use_distributed_optimizer
    assert [flag for flag, _ in run.megatron_flags] == [
        "--use-mcore-models", "--grad-reduce-in-bf16", "--manual-gc", "--empty-unused-memory-level",
        "--no-create-attention-mask-in-dataloader", "--log-throughput", "--ckpt-format"]
    assert (run.training.train_iters, run.training.train_samples) == (1953125000 // 8, 1953125000)
    scheduler = build_scheduler(run, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0))
    assert (scheduler.lr_decay_steps, scheduler.lr_warmup_steps, scheduler.wd_incr_steps) == (
        1949218748, 3906252, 1953125000)
    from teratron.estimate.report import estimate_from_args

    assert estimate_from_args(parse_train_args(argv), 8, "cuda").stages  # the estimate takes --train-samples too


# ---- Megatron's resume rule for the learning-rate / weight-decay schedule -------------------

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-2", "--min-lr", "1e-4", "--lr-decay-style", "linear",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--no-progress-bar", "--seed", "7"]


def _linear_lr(iteration, decay_iters, warmup_iters=1, max_lr=1e-2, min_lr=1e-4):
    """Megatron's linear schedule after `iteration` steps (the lr the log line shows)."""
    if iteration <= warmup_iters:
        return max_lr * iteration / warmup_iters
    if iteration > decay_iters:
        return min_lr
    return min_lr + (max_lr - min_lr) * (1 - (iteration - warmup_iters) / (decay_iters - warmup_iters))


def _logged_lrs(metrics_file):
    with open(metrics_file) as f:
        return {r["iteration"]: r["lr"] for r in map(json.loads, f) if "lr" in r}


def test_resume_with_another_schedule_needs_a_rule(tmp_path, capsys):
    """Saved at iteration 2 of --train-iters 4, resumed with --train-iters 8: without a flag the
    run stops with one line naming the decay lengths and both flags, writing nothing; with
    --override-opt_param-scheduler the lr follows the 8-iteration decay; with
    --use-checkpoint-opt_param-scheduler the 4-iteration one goes on (the lr reaches the floor
    after iteration 4)."""
    first = tmp_path / "first"
    assert cli.main(["train"] + TINY + ["--train-iters", "4", "--save", str(first), "--save-interval", "2",
                                        "--exit-interval", "2"]) == 0
    assert sorted(os.listdir(first)) == ["iter_0000002", storage.TRACKER_FILENAME]
    capsys.readouterr()

    def resume(name, *flags):
        folder = tmp_path / name
        shutil.copytree(first, folder)
        metrics = tmp_path / f"{name}.jsonl"
        status = cli.main(["train"] + TINY + ["--train-iters", "8", "--load", str(folder), "--save", str(folder),
                                              "--save-interval", "8", "--metrics-file", str(metrics), *flags])
        return status, folder, metrics

    status, folder, metrics = resume("strict")
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"teratron: error: --load {folder / 'iter_0000002'}: the learning-rate/weight-decay "
                          "schedule differs from the checkpoint's: ")
    # In samples (global batch 4): decay over 8 iterations now, 4 in the checkpoint.
    assert ("lr_decay_steps (--lr-decay-iters/-samples, default --train-iters/-samples; in samples) is 32 now, 16 in "
            "the checkpoint") in err
    assert "wd_incr_steps (--train-iters/-samples; in samples) is 32 now, 16 in the checkpoint" in err
    assert err.endswith("pass --override-opt_param-scheduler to follow this command line's schedule or "
                        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    assert sorted(os.listdir(folder)) == ["iter_0000002", storage.TRACKER_FILENAME] and not metrics.exists()
    assert (folder / storage.TRACKER_FILENAME).read_text() == "2"

    status, _, metrics = resume("override", "--override-opt_param-scheduler")
    assert status == 0
    lrs = _logged_lrs(metrics)
    assert sorted(lrs) == list(range(3, 9))
    for iteration, lr in lrs.items():
        assert lr == pytest.approx(_linear_lr(iteration, decay_iters=8), rel=1e-12), iteration

    status, _, metrics = resume("checkpoint", "--use-checkpoint-opt-param-scheduler")
    assert status == 0
    lrs = _logged_lrs(metrics)
    for iteration, lr in lrs.items():
        assert lr == pytest.approx(_linear_lr(iteration, decay_iters=4), rel=1e-12), iteration
    assert lrs[5] == lrs[8] == 1e-4 and not math.isclose(lrs[4], _linear_lr(4, decay_iters=8))

    capsys.readouterr()
    assert cli.main(["train"] + TINY + ["--train-iters", "8", "--override-opt_param-scheduler",
                                        "--use-checkpoint-opt_param-scheduler"]) == 2
    assert capsys.readouterr().err.strip() == (
        "teratron: error: --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler both given; "
        "choose one (this command line's schedule, or the checkpoint's)")


def test_exit_on_missing_checkpoint(tmp_path, capsys):
    assert cli.main(["train"] + TINY + ["--train-iters", "2", "--load", str(tmp_path / "empty"),
                                        "--exit-on-missing-checkpoint"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"teratron: error: --load {tmp_path / 'empty'}: no checkpoint ({storage.TRACKER_FILENAME} is "
                   "missing) and --exit-on-missing-checkpoint is set; pass a checkpoint folder or drop the flag to "
                   "start from scratch")


# ---- Megatron's sample-based run length and schedule ----------------------------------------

# TINY without its warm-up in iterations; the global batch is 4.
IN_SAMPLES = [a for i, a in enumerate(TINY) if "--lr-warmup-iters" not in TINY[max(i - 1, 0):i + 1]]


def _samples_lr(samples, warmup, decay, style="cosine", wsd_decay=None, max_lr=1e-2, min_lr=1e-4):
    """Megatron's schedule after `samples` samples: linear warm-up, then cosine, or WSD holding
    max_lr until its final linear anneal of `wsd_decay` samples; min_lr after the decay."""
    if samples <= warmup:
        return max_lr * samples / warmup
    if samples > decay:
        return min_lr
    if style == "cosine":
        return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * (samples - warmup) / (decay - warmup)) + 1)
    anneal_start = decay - wsd_decay
    if samples <= anneal_start:
        return max_lr
    return min_lr + (max_lr - min_lr) * (1 - (samples - anneal_start) / wsd_decay)


def _train(tmp_path, name, *flags):
    """iteration -> (lr, loss) of a `teratron train` run of IN_SAMPLES and `flags`."""
    metrics = tmp_path / f"{name}.jsonl"
    assert cli.main(["train"] + IN_SAMPLES + ["--metrics-file", str(metrics), *flags]) == 0
    with open(metrics) as f:
        return {r["iteration"]: (r["lr"], r["lm_loss"]) for r in map(json.loads, f) if "lr" in r}


@pytest.mark.parametrize("style", ["cosine", "WSD"])
def test_sample_based_schedule_is_megatrons_and_equals_the_run_in_iterations(tmp_path, style):
    """--train-samples 26 / --lr-decay-samples 22 / --lr-warmup-samples 6 (WSD: the last 12
    samples anneal) with global batch 4: 6 iterations, the lr after iteration i is the schedule at
    4 i samples (warm-up, anneal and decay ends fall between iterations). Given in samples that
    are whole batches of a run in iterations, the lrs and losses are that run's."""
    flags = ["--lr-decay-style", style, "--lr-wsd-decay-style", "linear"]

    def wsd(unit, length):
        return [f"--lr-wsd-decay-{unit}", str(length)] if style == "WSD" else []

    lrs = _train(tmp_path, "samples", "--train-samples", "26", "--lr-decay-samples", "22",
                 "--lr-warmup-samples", "6", *flags, *wsd("samples", 12))
    assert sorted(lrs) == list(range(1, 7))
    for iteration, (lr, _) in lrs.items():
        assert lr == pytest.approx(_samples_lr(4 * iteration, 6, 22, style, wsd_decay=12), rel=1e-12), iteration
    assert lrs[6][0] == 1e-4 and len({lr for lr, _ in lrs.values()}) == 6

    in_iters = _train(tmp_path, "iters", "--train-iters", "6", "--lr-decay-iters", "5", "--lr-warmup-iters", "2",
                      *flags, *wsd("iters", 2))
    in_samples = _train(tmp_path, "same", "--train-samples", "24", "--lr-decay-samples", "20",
                        "--lr-warmup-samples", "8", *flags, *wsd("samples", 8))
    assert in_samples == in_iters
    for iteration, (lr, _) in in_samples.items():
        assert lr == pytest.approx(_samples_lr(4 * iteration, 8, 20, style, wsd_decay=8), rel=1e-12), iteration


def test_sample_based_schedule_resumes_in_samples(tmp_path, capsys):
    """Saved at iteration 3 of a run in samples: the checkpoint's scheduler counts samples
    (Megatron's state_dict names), the resumed run logs the uninterrupted run's lrs; a checkpoint
    of the run in iterations resumes under the corresponding samples (the check compares samples
    with samples), and a decay length that differs is named in one line."""
    schedule = ["--train-samples", "24", "--lr-decay-samples", "20", "--lr-warmup-samples", "8",
                "--lr-decay-style", "cosine"]
    whole = _train(tmp_path, "whole", *schedule)
    first = tmp_path / "first"
    _train(tmp_path, "first", *schedule, "--save", str(first), "--save-interval", "3", "--exit-interval", "3")
    from teratron.dist_checkpointing.safe_load import read_common_state

    state = read_common_state(str(first / "iter_0000003"))["opt_param_scheduler"]
    assert (state["num_steps"], state["lr_decay_steps"], state["lr_warmup_steps"], state["wd_incr_steps"]) == (
        12, 20, 8, 24)
    resumed = _train(tmp_path, "resumed", *schedule, "--load", str(first))
    assert resumed == {i: whole[i] for i in range(4, 7)}

    in_iters = tmp_path / "in_iters"
    _train(tmp_path, "in_iters", "--train-iters", "6", "--lr-decay-iters", "5", "--lr-warmup-iters", "2",
           "--lr-decay-style", "cosine", "--save", str(in_iters), "--save-interval", "3", "--exit-interval", "3")
    assert _train(tmp_path, "from_iters", *schedule, "--load", str(in_iters)) == resumed
    capsys.readouterr()
    assert cli.main(["train"] + IN_SAMPLES + schedule + ["--lr-decay-samples", "21", "--load", str(first)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lr_decay_steps (--lr-decay-iters/-samples, default " \
        "--train-iters/-samples; in samples) is 21 now, 20 in the checkpoint" in err, err
