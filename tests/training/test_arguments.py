import pytest

from teratron.training.arguments import parse_train_args
from teratron.training.config import check_interleaved_schedule, run_config_from_args

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


def _run(argv, world_size=1):
    """The run description of `argv` (a vocabulary of 64: no tokenizer needed)."""
    return run_config_from_args(parse_train_args(argv), world_size, vocab_size=64, cuda=False)


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
    demo = parse_train_args(["--train-samples", "3200"])  # the demo's length in samples instead
    assert demo.demo and (demo.train_iters, demo.train_samples) == (None, 3200)
    assert run_config_from_args(demo, 1, vocab_size=64, cuda=False).training.train_iters == 200  # batch 16
    real = parse_train_args(BASE)
    assert not real.demo and real.lr_decay_style == "linear" and real.hidden_dropout == 0.1


def test_derived_values_follow_megatron():
    run = _run(BASE + ["--swiglu"], world_size=4)
    assert run.distributed.data_parallel_size == 4
    assert run.training.global_batch_size == 8          # micro x DP
    assert run.transformer.kv_channels == 16
    assert run.transformer.ffn_hidden_size == 128       # int(4 * 64 * 2 / 3 / 64) * 64
    assert run.model.max_position_embeddings == 32
    assert run.scheduler.lr_decay_iters == 10


def test_validation_errors():
    cases = [
        (["--global-batch-size", "3"], "--global-batch-size \\(3\\) is not divisible"),
        (["--fp16", "--bf16"], "fp16 and bf16 are both True; choose one mixed-precision mode \\(--fp16 or --bf16\\)"),
        (["--tensor-model-parallel-size", "3"], "not divisible by TP \\(3\\)"),
        (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
        (["--save-interval", "5"], "without --save"),
        (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups \\(0\\) must divide"),
        (["--seed", "-1"], "--seed must be in"),
        (["--lr", "-1"], "--lr=-1.0 must be a finite number >= 0"),
        (["--save", "x", "--save-interval", "0"], "--save-interval must be >= 1"),
        (["--ddp-copy-engine-collectives"], "--ddp-copy-engine-collectives needs --use-distributed-optimizer"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            _run(BASE + extra)
    with pytest.raises(ValueError, match="missing required flag\\(s\\) --lr"):
        _run([a for a in BASE if a not in ("--lr", "1e-3")])


def test_megatron_attention_softmax_switch_is_accepted():
    assert parse_train_args(BASE).attention_softmax_in_fp32
    assert parse_train_args(BASE + ["--attention-softmax-in-fp32"]).attention_softmax_in_fp32
    assert not parse_train_args(BASE + ["--no-attention-softmax-in-fp32"]).attention_softmax_in_fp32


def test_transformer_config_from_args():
    config = _run(BASE + ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups",
                          "2", "--disable-bias-linear", "--hidden-dropout", "0.0"]).transformer
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
        _run(["--config", str(path)] + data)


def _pipeline(flags, world_size):
    run = _run(BASE + ["--global-batch-size", "8"] + flags, world_size)
    check_interleaved_schedule(run)
    return run, run.transformer


def test_pipeline_flags_reach_the_config():
    from teratron.pipeline_parallel.layout import stage_layer_counts

    # A layout sets the virtual stages: [E] [t] | [t] [L] is PP 2 x VPP 2.
    args, config = _pipeline(["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                              "E|t|t|L"], 2)
    assert config.virtual_pipeline_model_parallel_size == 2
    assert stage_layer_counts(config, 2) == [0, 1, 1, 0]
    assert config.deallocate_pipeline_outputs and config.microbatch_group_size_per_vp_stage == 2

    # Uneven first/last stages with virtual stages: the middle rank's 4 layers make 2 chunks of 2.
    args, config = _pipeline(["--num-layers", "8", "--pipeline-model-parallel-size", "3",
                              "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers",
                              "2", "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "12"], 3)
    assert config.virtual_pipeline_model_parallel_size == 2
    assert stage_layer_counts(config, 3) == [1, 2, 1, 1, 2, 1]

    # The embedding and loss counted as layers: (6 + 2) / 2 ranks = 4, 2 chunks of 2.
    args, config = _pipeline(["--num-layers", "6", "--pipeline-model-parallel-size", "2",
                              "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                              "--num-layers-per-virtual-pipeline-stage", "2"], 2)
    assert stage_layer_counts(config, 2) == [1, 2, 2, 1]

    args, config = _pipeline(["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                              "--num-virtual-stages-per-pipeline-rank", "2",
                              "--microbatch-group-size-per-virtual-pipeline-stage", "4",
                              "--global-batch-size", "16"], 2)
    assert config.virtual_pipeline_model_parallel_size == 2 and config.microbatch_group_size_per_vp_stage == 4


def test_pipeline_flag_errors():
    pp2 = ["--pipeline-model-parallel-size", "2"]
    vpp2 = pp2 + ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
    cases = [
        # 2 micro-batches per step (4 / (2 x DP 1)) but groups of 4.
        (vpp2 + ["--global-batch-size", "4", "--microbatch-group-size-per-virtual-pipeline-stage", "4"],
         r"multiple of --microbatch-group-size-per-virtual-pipeline-stage \(4; .*= 2"),
        (vpp2 + ["--microbatch-group-size-per-virtual-pipeline-stage", "1"], r"\(1\) must be at least"),
        (pp2 + ["--pipeline-model-parallel-layout", "Et|tL", "--num-layers-per-virtual-pipeline-stage", "1"],
         "both given"),
        (pp2 + ["--pipeline-model-parallel-layout", "Et|t|L"], "--pipeline-model-parallel-layout: .*multiple"),
        (pp2 + ["--pipeline-model-parallel-layout", "Et|ttL"], "--pipeline-model-parallel-layout: .*num_layers is 2"),
        (pp2 + ["--pipeline-model-parallel-layout", "E|t|t|L", "--virtual-pipeline-model-parallel-size", "3"],
         "drop the flag"),
        (pp2 + ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1",
                "--num-layers-per-virtual-pipeline-stage", "1"], "--virtual-pipeline-model-parallel-size instead"),
        (pp2 + ["--num-layers-per-virtual-pipeline-stage", "2"], r"must divide .*\(2 layers over 2"),
        (["--virtual-pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            _pipeline(extra, 2)


def test_optimizer_and_ddp_flags():
    run = _run(BASE + [
        "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5", "--no-pin-cpu-params",
        "--decoupled-lr", "1e-4", "--apply-wd-to-qk-layernorm", "--lion-beta1", "0.9",
        "--muon-momentum", "0.8", "--muon-no-split-qkv", "--muon-use-nesterov", "--muon-tp-mode", "duplicated",
        "--muon-num-ns-steps", "3", "--muon-scalar-optimizer", "lion",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--ddp-bucket-size", "1000", "--ddp-average-in-collective", "--ddp-pad-buckets-for-high-nccl-busbw"], 2)
    opt = run.optimizer
    assert opt.optimizer_cpu_offload and opt.optimizer_offload_fraction == 0.5 and not opt.pin_cpu_params
    assert opt.decoupled_lr == 1e-4 and opt.decoupled_min_lr == 0.0 and opt.apply_wd_to_qk_layernorm
    assert opt.lion_beta1 == 0.9 and opt.muon_momentum == 0.8 and not opt.muon_split_qkv and opt.muon_nesterov
    assert (opt.muon_tp_mode, opt.muon_num_ns_steps, opt.muon_scalar_optimizer) == ("duplicated", 3, "lion")
    # The distributed optimizer is the DDP buffers' to switch on: one config holds it.
    assert not hasattr(opt, "use_distributed_optimizer") and not hasattr(opt, "overlap_param_gather")
    ddp = run.ddp
    assert ddp.use_distributed_optimizer and ddp.overlap_grad_reduce and ddp.overlap_param_gather
    assert ddp.bucket_size == 1000 and ddp.average_in_collective and ddp.pad_buckets_for_high_nccl_busbw

    for extra, message in [(["--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction"),
                           (["--optimizer", "muon", "--optimizer-cpu-offload"], "--optimizer=muon"),
                           (["--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-3"], "--decoupled-min-lr")]:
        with pytest.raises(ValueError, match=message):
            _run(BASE + extra)


def test_moe_layer_freq_grammar():
    import argparse

    from teratron.training.arguments import moe_freq_type

    assert moe_freq_type("2") == 2
    assert moe_freq_type("[1,0,1,0]") == [1, 0, 1, 0]
    assert moe_freq_type("([1]*3+[0])*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    assert moe_freq_type("[0] + 3 * [1]") == [0, 1, 1, 1]
    # Anything but int/list literals, + and * is refused without being evaluated.
    for text, message in [("__import__('os').getcwd()", "neither an int nor a list"),
                          ("[__import__('os')]", "is not allowed"), ("[1]*2**3", "is not allowed"),
                          ("[1]*[2]", "repeats a list"), ("[1]+2", "joins two lists"),
                          ("[[1]]", "nested"), ("[1.0]", "is not allowed"), ("[1,", "never closed"),
                          ("[1]*100000000", "longer than")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            moe_freq_type(text)
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        parse_train_args(BASE + ["--moe-layer-freq", "[1]*[2]"])


MOE = BASE + ["--num-experts", "4", "--global-batch-size", "4"]


def test_moe_flags_reach_the_config(tmp_path):
    config = _run(MOE + [
        "--num-layers", "4", "--moe-layer-freq", "([1,0])*2", "--moe-router-topk", "2",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.01", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp64", "--moe-z-loss-coeff", "1e-3",
        "--moe-input-jitter-eps", "0.01", "--moe-expert-capacity-factor", "1.5",
        "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy", "position",
        "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-overlap", "--moe-per-layer-logging",
        "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "0.001",
        "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--expert-model-parallel-size", "2"],
        2).transformer
    assert config.num_moe_experts == 4 and config.moe_layer_freq == [1, 0, 1, 0]
    assert config.moe_ffn_hidden_size == config.ffn_hidden_size == 256  # default: the dense size
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias,
            config.moe_router_bias_update_rate) == ("sigmoid", True, 0.01)
    assert (config.moe_router_num_groups, config.moe_router_group_topk, config.moe_router_topk_scaling_factor,
            config.moe_router_dtype) == (2, 1, 2.5, "fp64")
    assert (config.moe_z_loss_coeff, config.moe_input_jitter_eps, config.moe_expert_capacity_factor) == (
        1e-3, 0.01, 1.5)
    assert config.moe_pad_expert_input_to_capacity and config.moe_token_drop_policy == "position"
    assert config.moe_shared_expert_intermediate_size == 32 and config.moe_shared_expert_overlap
    assert config.moe_per_layer_logging and config.moe_grouped_gemm
    assert config.moe_router_load_balancing_type == ["aux_loss", "seq_aux_loss"]
    assert config.moe_aux_loss_coeff == [0.01, 0.001]
    assert config.moe_token_dispatcher_type == "alltoall" and config.expert_model_parallel_size == 2

    # One balancing type and coefficient are scalars, as Megatron passes them; the rest of the flags.
    config = _run(MOE + [
        "--moe-router-load-balancing-type", "quantile_balancing", "--moe-router-quantile-balancing-ema", "0.5",
        "--moe-router-pre-softmax", "--moe-router-force-load-balancing", "--moe-apply-probs-on-input",
        "--moe-router-topk", "1", "--moe-layer-freq", "2"]).transformer
    assert config.moe_router_load_balancing_type == "quantile_balancing" and config.moe_aux_loss_coeff == 0.0
    assert config.moe_router_quantile_balancing_ema == 0.5 and config.moe_router_pre_softmax
    assert config.moe_router_force_load_balancing and config.moe_apply_probs_on_input
    assert config.moe_layer_freq == 2

    # A YAML list for a one-value flag becomes that flag's list syntax.
    cfg = tmp_path / "moe.yaml"
    cfg.write_text("moe-layer-freq: [0, 1]\nmoe-router-load-balancing-type: [aux_loss, z_loss_free]\n")
    with pytest.raises(ValueError, match="invalid choice: 'z_loss_free'"):
        parse_train_args(MOE + ["--config", str(cfg)])
    cfg.write_text("moe-layer-freq: [0, 1]\nmoe-aux-loss-coeff: [0.5]\n")
    config = _run(MOE + ["--config", str(cfg)]).transformer
    assert config.moe_layer_freq == [0, 1] and config.moe_aux_loss_coeff == 0.5


def test_moe_flag_errors():
    cases = [
        (["--moe-layer-freq", "[1,0,1]"], r"--moe-layer-freq as a list needs one 0/1 entry per layer \(2\), got \[1, 0, 1\]"),
        (["--moe-layer-freq", "[1,2]"], "needs one 0/1 entry per layer"),
        (["--moe-layer-freq", "0"], "--moe-layer-freq must be >= 1"),
        (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], "2 value\\(s\\) but --moe-aux-loss-coeff 1"),
        (["--expert-model-parallel-size", "3", "--num-experts", "6"], r"not divisible by expert TP \(1\) x EP \(3\)"),
        (["--expert-model-parallel-size", "2", "--num-experts", "3"], r"--num-experts \(3\) is not divisible"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            _run(MOE + extra, 2)


def test_moe_example_configs_build_their_transformer_config():
    import pathlib

    examples = pathlib.Path(__file__).parents[2] / "examples" / "moe"
    configs = {}
    for path in sorted(examples.glob("*.yaml")):
        configs[path.stem] = _run(["--config", str(path), "--data-path", "some/prefix"], 8).transformer
    mixtral, deepseek = configs["mixtral_like"], configs["deepseek_like"]
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk, mixtral.moe_layer_freq) == (8, 2, 1)
    assert mixtral.moe_aux_loss_coeff == 0.02 and mixtral.moe_z_loss_coeff == 0.001
    assert mixtral.expert_model_parallel_size == 8 and mixtral.gated_linear_unit
    assert deepseek.moe_layer_freq == [0] + [1] * 11 and deepseek.num_moe_experts == 64
    assert (deepseek.moe_router_score_function, deepseek.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (deepseek.moe_router_num_groups, deepseek.moe_router_group_topk) == (8, 4)
    assert deepseek.moe_shared_expert_intermediate_size == 256 and deepseek.moe_router_topk_scaling_factor == 2.5


IN_SAMPLES = [a for a in BASE if a not in ("--train-iters", "10")] + ["--global-batch-size", "4"]


def test_sample_based_run_follows_megatron():
    """--train-samples: the run is its whole global batches (ramp-up included); the schedule's
    lengths stay in samples, decay defaulting to --train-samples."""
    run = _run(IN_SAMPLES + ["--train-samples", "45"])
    assert (run.training.train_iters, run.training.train_samples) == (11, 45)  # 45 // 4
    s = run.scheduler
    assert (s.unit, s.lr_decay_samples, s.lr_warmup_samples, s.lr_decay_iters) == ("samples", 45, 0, None)
    s = _run(IN_SAMPLES + ["--train-samples", "45", "--lr-decay-samples", "40", "--lr-warmup-samples", "6"]).scheduler
    assert (s.lr_decay_samples, s.lr_warmup_samples) == (40, 6)
    # Global batch 8 ramped up from 4 over 16 samples: 4 batches of 4, then (40 - 16) // 8 = 3 of 8.
    run = _run(IN_SAMPLES[:-1] + ["8", "--rampup-batch-size", "4", "4", "16", "--train-samples", "40"])
    assert run.training.train_iters == 7
    assert _run(BASE).scheduler.unit == "iters"
    # --lr-warmup-fraction is a fraction of the decay samples; the weight decay ramps over --train-samples.
    import torch
    from teratron.training.build import build_scheduler

    run = _run(IN_SAMPLES + ["--train-samples", "45", "--lr-decay-samples", "40", "--lr-warmup-fraction", "0.25"])
    scheduler = build_scheduler(run, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0))
    assert (scheduler.lr_warmup_steps, scheduler.lr_decay_steps, scheduler.wd_incr_steps) == (10, 40, 45)


def test_sample_based_flags_refused_in_one_line():
    """Megatron's asserts: one unit for the run and its schedule."""
    samples = IN_SAMPLES + ["--train-samples", "40"]
    cases = [
        (BASE + ["--train-samples", "40"], "--train-iters and --train-samples both given; choose one (the run's "
                                           "length in iterations or in samples)"),
        (samples + ["--lr-decay-iters", "5"], "--lr-decay-iters counts iterations but the run is given in "
                                              "--train-samples; use --lr-decay-samples"),
        (samples + ["--lr-warmup-iters", "1"], "--lr-warmup-iters counts iterations but the run is given in "
                                               "--train-samples; use --lr-warmup-samples"),
        (samples + ["--lr-wsd-decay-iters", "2"], "--lr-wsd-decay-iters counts iterations but the run is given in "
                                                  "--train-samples; use --lr-wsd-decay-samples"),
        (BASE + ["--lr-decay-samples", "5"], "--lr-decay-samples counts samples but the run is given in "
                                             "--train-iters; use --lr-decay-iters"),
        (BASE + ["--lr-warmup-samples", "8"], "--lr-warmup-samples counts samples but the run is given in "
                                              "--train-iters; use --lr-warmup-iters"),
        (BASE + ["--lr-wsd-decay-samples", "8"], "--lr-wsd-decay-samples counts samples but the run is given in "
                                                 "--train-iters; use --lr-wsd-decay-iters"),
        (IN_SAMPLES + ["--train-samples", "3"], "--train-samples (3) is less than one global batch (4); raise it"),
        (samples + ["--lr-warmup-samples", "40"], "--lr-warmup-samples (40) must be smaller than --lr-decay-samples "
                                                  "(40; default --train-samples)"),
        (samples + ["--lr-warmup-samples", "4", "--lr-warmup-fraction", "0.1"],
         "--lr-warmup-fraction and --lr-warmup-samples both given; choose one"),
        (samples + ["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-samples (length of the "
                                                "final decay)"),
        (IN_SAMPLES, "missing required flag(s) --train-iters (or --train-samples) (or set them in --config)"),
    ]
    for argv, message in cases:
        with pytest.raises(ValueError) as error:
            _run(argv)
        assert str(error.value) == message, argv
