"""The run description (teratron.training.config): one table from flags to fields, frozen
sections, errors in flag terms, device-dependent defaults, and the parse-time checks of the
optimizer's hyperparameters and of --config files."""

import dataclasses
import json
from dataclasses import fields

import pytest

from teratron import cli
from teratron.training import config as run_config
from teratron.training.arguments import build_train_parser, parse_train_args
from teratron.training.build import build_model
from teratron.training.config import in_flag_terms, run_config_from_args

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


def _run(argv, cuda=False, world_size=1):
    return run_config_from_args(parse_train_args(BASE + argv), world_size, vocab_size=64, cuda=cuda)


def test_every_flag_has_a_place_in_the_run_description():
    dests = {a.dest for a in build_train_parser()._actions if a.dest != "help"}
    fields_by_name = {f.name for section in run_config.SECTIONS.values() for f in fields(section)}
    placed = (fields_by_name | set(run_config.RENAMED) | set(run_config.COMMAND_ONLY) | set(run_config.INPUTS_ONLY)
              | set(run_config.RUN_FIELDS))
    assert sorted(dests - placed) == []
    # Renamed flags name real fields of their section.
    for dest, (section, name, _) in run_config.RENAMED.items():
        assert name in {f.name for f in fields(run_config.SECTIONS[section])}, dest


def test_flags_reach_their_sections():
    run = _run(["--swiglu", "--norm-epsilon", "1e-6", "--untie-embeddings-and-output-weights",
                "--accumulate-allreduce-grads-in-fp32", "--ddp-bucket-size", "1000", "--save", "out",
                "--save-interval", "5", "--log-interval", "3", "--num-workers", "0", "--data-cache-path", "cache",
                "--eval-iters", "7", "--weight-decay", "0.2"])
    assert run.transformer.gated_linear_unit and run.transformer.layernorm_epsilon == 1e-6
    assert not run.model.share_embeddings_and_output_weights and run.model.padded_vocab_size == 128
    assert run.ddp.grad_reduce_in_fp32 and run.ddp.bucket_size == 1000
    assert (run.checkpoint.save, run.checkpoint.save_interval) == ("out", 5)
    assert (run.logging.log_interval, run.data.num_workers, run.data.data_cache_path) == (3, 0, "cache")
    assert run.training.eval_iters == 7
    # The constant weight-decay schedule starts and ends at --weight-decay.
    assert run.scheduler.start_weight_decay == run.scheduler.end_weight_decay == run.optimizer.weight_decay == 0.2


def test_the_run_description_is_frozen_and_building_leaves_it_unchanged():
    run = _run([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.training.train_iters = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.model = None
    import torch

    model = build_model(run, torch.device("cpu"))
    assert model[0].config is not run.transformer  # the model's copy carries the schedule's callbacks
    assert model[0].config.num_layers == run.transformer.num_layers
    json.dumps(run.to_dict())  # what a checkpoint records is plain data


def test_config_errors_name_the_flags():
    assert in_flag_terms("num_query_groups (3) must divide num_attention_heads (4)") == (
        "--num-query-groups (3) must divide --num-attention-heads (4)")
    assert in_flag_terms("gated_linear_unit and num_moe_experts") == "--swiglu and --num-experts"
    # A field whose flag turns it off is named by its flag, except where its value is quoted.
    assert in_flag_terms("add_bias_linear (saved True)") == "--disable-bias-linear (saved True)"
    assert in_flag_terms("add_bias_linear=True needs x") == "add_bias_linear=True needs x"
    # Words that are only one-word field names stay words; as fields they are flags.
    assert in_flag_terms("save the model; lr=0.5 and min_lr (1.0)") == "save the model; --lr=0.5 and --min-lr (1.0)"
    with pytest.raises(ValueError, match=r"^--hidden-size \(30\) is not divisible by --num-attention-heads"):
        _run(["--hidden-size", "30"])


def test_fast_paths_are_the_cuda_default():
    fast = _run([], cuda=True)
    assert fast.training.torch_compile and fast.transformer.gradient_accumulation_fusion
    slow = _run([], cuda=False)
    assert not slow.training.torch_compile and not slow.transformer.gradient_accumulation_fusion
    off = _run(["--no-torch-compile", "--no-gradient-accumulation-fusion"], cuda=True)
    assert not off.training.torch_compile and not off.transformer.gradient_accumulation_fusion
    on = _run(["--torch-compile", "--gradient-accumulation-fusion"], cuda=False)
    assert on.training.torch_compile and on.transformer.gradient_accumulation_fusion
    # Local CUDA graphs refuse gradient-accumulation fusion: neither lever defaults on with them.
    graphs = _run(["--cuda-graph-impl", "local", "--hidden-dropout", "0", "--attention-dropout", "0"], cuda=True)
    assert not graphs.training.torch_compile and not graphs.transformer.gradient_accumulation_fusion


def test_yaml_false_turns_a_device_default_off(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("torch-compile: false\ngradient-accumulation-fusion: false\n")
    run = _run(["--config", str(cfg)], cuda=True)
    assert not run.training.torch_compile and not run.transformer.gradient_accumulation_fusion


@pytest.mark.parametrize("extra, message", [
    (["--lr", "inf"], "--lr=inf must be a finite number >= 0"),
    (["--min-lr", "nan"], "--min-lr=nan must be a finite number >= 0"),
    (["--weight-decay", "inf"], "--weight-decay=inf must be a finite number >= 0"),
    (["--clip-grad", "nan"], "--clip-grad=nan must be a finite number >= 0"),
    (["--adam-beta1", "1.0"], r"--adam-beta1=1.0 must be in \[0, 1\)"),
    (["--adam-beta2", "nan"], r"--adam-beta2=nan must be in \[0, 1\)"),
    (["--adam-eps", "inf"], "--adam-eps=inf must be a finite number >= 0"),
    (["--min-lr", "1.0"], r"--min-lr \(1.0\) is larger than --lr \(0.001\)"),
])
def test_optimizer_hyperparameters_are_finite_and_in_range(extra, message):
    with pytest.raises(ValueError, match=message):
        _run(extra)


def test_yaml_aliases_and_huge_files_are_refused(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text('a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
                    'c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nnum-layers: *c\n')
    huge = tmp_path / "huge.yaml"
    huge.write_text("# padding\n" * 200_000)
    for path, phrase in ((bomb, "aliases are not allowed"), (huge, "larger than 1048576 bytes")):
        assert cli.main(["train", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("teratron: error: --config ") and phrase in err


def test_estimate_of_an_example_config_takes_no_demo_defaults(capsys):
    """The demo's schedule (--lr-warmup-fraction) never mixes with a --config that is given."""
    import pathlib

    example = pathlib.Path(__file__).parents[2] / "examples" / "llama_1b.yaml"
    assert cli.main(["estimate", "--config", str(example), "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["layout"]["tp"] >= 1 and estimate["model_parameters"] > 1e9


def test_sample_based_sections_are_checked_without_flags():
    """Configs built in Python: the schedule counts in one unit, and train_iters is
    train_samples' whole global batches."""
    with pytest.raises(ValueError, match=r"^lr_warmup_iters with lr_decay_samples: the schedule counts in one unit; "
                                         r"use lr_warmup_samples$"):
        run_config.SchedulerConfig(lr_decay_samples=8, lr_warmup_iters=1, start_weight_decay=0.0,
                                   end_weight_decay=0.0)
    with pytest.raises(ValueError, match=r"^the schedule needs lr_decay_iters or lr_decay_samples"):
        run_config.SchedulerConfig(start_weight_decay=0.0, end_weight_decay=0.0)
    run = run_config_from_args(parse_train_args([a for a in BASE if a not in ("--train-iters", "10")]
                                                + ["--train-samples", "9"]), 1, vocab_size=64, cuda=False)
    assert run.training.train_iters == 4  # 9 // global batch 2
    with pytest.raises(ValueError, match=r"^train_iters \(3\) must be the whole global batches in train_samples "
                                         r"\(9\): 4$"):
        dataclasses.replace(run, training=dataclasses.replace(run.training, train_iters=3))
