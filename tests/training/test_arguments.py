import pytest

from teratron.training.arguments import (core_transformer_config_from_args, parse_train_args,
                                         validate_args)

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


def test_yaml_config_and_flag_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num-layers: 4\nhidden_size: 128\nlr: 3e-4\nswiglu: true\n"
                   "disable-bias-linear: true\nbf16: false\ndata-path: [a, b]\n")
    args = parse_train_args(["--config", str(cfg), "--num-layers", "6", "--data-path", "c"])
    assert args.num_layers == 6            # the flag wins
    assert args.hidden_size == 128         # underscores work
    assert args.lr == pytest.approx(3e-4)  # YAML's "3e-4" string goes through the flag's type
    assert args.swiglu and not args.add_bias_linear and not args.bf16
    assert args.data_path == ["c"]
    assert not args.demo


def test_yaml_errors(tmp_path):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("num-layerz: 4\n")
    with pytest.raises(ValueError, match="unknown key 'num-layerz'"):
        parse_train_args(["--config", str(bad_key)])
    bad_switch = tmp_path / "b.yaml"
    bad_switch.write_text("swiglu: 3\n")
    with pytest.raises(ValueError, match="swiglu is a switch"):
        parse_train_args(["--config", str(bad_switch)])
    with pytest.raises(FileNotFoundError, match="--config"):
        parse_train_args(["--config", str(tmp_path / "missing.yaml")])


def test_demo_defaults_apply_only_without_data_flags():
    demo = parse_train_args(["--train-iters", "7"])
    assert demo.demo and demo.train_iters == 7 and demo.num_layers == 4
    real = parse_train_args(BASE)
    assert not real.demo and real.lr_decay_style == "linear" and real.hidden_dropout == 0.1


def test_derived_values_follow_megatron():
    args = validate_args(parse_train_args(BASE + ["--swiglu"]), world_size=4)
    assert args.data_parallel_size == 4
    assert args.global_batch_size == 8          # micro x DP
    assert args.kv_channels == 16
    assert args.ffn_hidden_size == 128          # int(4 * 64 * 2 / 3 / 64) * 64
    assert args.max_position_embeddings == 32
    assert args.lr_decay_iters == 10


def test_validation_errors():
    cases = [
        (["--global-batch-size", "3"], "--global-batch-size \\(3\\) is not divisible"),
        (["--fp16", "--bf16"], "--fp16 and --bf16"),
        (["--tensor-model-parallel-size", "3"], "not divisible by TP \\(3\\)"),
        (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
        (["--save-interval", "5"], "without --save"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            validate_args(parse_train_args(BASE + extra), 1)
    with pytest.raises(ValueError, match="missing required flag\\(s\\) --lr"):
        validate_args(parse_train_args([a for a in BASE if a not in ("--lr", "1e-3")]), 1)


def test_transformer_config_from_args():
    args = validate_args(parse_train_args(BASE + ["--swiglu", "--normalization", "RMSNorm",
                                                  "--group-query-attention", "--num-query-groups", "2",
                                                  "--disable-bias-linear", "--hidden-dropout", "0.0"]), 1)
    config = core_transformer_config_from_args(args)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert config.gated_linear_unit and config.normalization == "RMSNorm"
    assert config.num_query_groups == 2 and not config.add_bias_linear
    assert config.hidden_dropout == 0.0 and config.ffn_hidden_size == 128


def test_example_configs_parse_and_validate():
    import pathlib

    examples = sorted((pathlib.Path(__file__).parents[2] / "examples").glob("*.yaml"))
    assert len(examples) >= 3
    for path in examples:
        data = [] if "mock-data: true" in path.read_text() else ["--data-path", "some/prefix"]
        args = parse_train_args(["--config", str(path)] + data)
        validate_args(args, world_size=1)
        core_transformer_config_from_args(args)
