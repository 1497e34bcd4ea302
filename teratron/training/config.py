"""The run description: every setting of a `teratron train` run, typed, checked once, frozen.

    args = parse_train_args(argv)                          # flags over --config YAML (arguments.py)
    run = run_config_from_args(args, world_size, vocab_size)

`RunConfig` is a tree of frozen dataclasses, one per concern: the model (`GPTModelConfig`, whose
`transformer` is Megatron's `TransformerConfig` with the parallel sizes), the optimizer and DDP
(Megatron's `OptimizerConfig` and `DistributedDataParallelConfig`), and teratron's sections for
the LR schedule, training loop, data, tokenizer, checkpoints, logging, profiling and processes.

Each rule is checked by the config it belongs to (its `__post_init__`); rules across sections by
`RunConfig`. `run_config_from_args` is the one table from flags to fields: a flag sets the
field of its own name in every section that has one, `RENAMED` lists the flags whose field is
called otherwise, and `DERIVED` names the values filled in from others (Megatron's defaults).
Errors raised by Megatron's configs name fields; `in_flag_terms` rewrites them with the flags.
Nothing mutates a RunConfig once built: the Trainer gives the model a copy of the
TransformerConfig for the schedule's callbacks.
"""

import argparse
import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field, fields
from typing import Optional

import torch
import torch.nn.functional as F

from teratron.distributed import DistributedDataParallelConfig
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.models.hybrid.hybrid_layer_allocation import gdp_layers_of_spec
from teratron.optimizer import OptimizerConfig
from teratron.parallel_state import launched_by_torchrun
from teratron.dist_checkpointing.model_args import YARN_ARGS
from teratron.training.arguments import MLA_FLAG_DEFAULTS, flag, flags_by_dest, inverted_dests
from teratron.training.microbatches import build_num_microbatches_calculator
from teratron.pipeline_parallel.layout import PipelineParallelLayerLayout
from teratron.transformer.cuda_graphs import NEED_CUDA
from teratron.transformer.mlp import openai_gelu, quick_gelu, squared_relu
from teratron.training.telemetry import span_groups
from teratron.transformer.transformer_config import YARN_FIELDS, MLATransformerConfig, TransformerConfig


def _at_least(section, minimum, names) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < minimum:
            raise ValueError(f"{flag(name)} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class TrainingConfig:
    """The training loop: batches, length, seeds, NaN handling, evaluation and exits."""
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    seq_length: int
    rampup_batch_size: Optional[tuple] = None
    train_samples: Optional[int] = None
    """The run length in samples (Megatron's --train-samples); train_iters is then its whole global batches."""
    seed: int = 1234
    deterministic_mode: bool = False
    check_for_nan_in_loss_and_grad: bool = True
    skip_nan_steps: bool = False
    rerun_mode: str = "validate_results"
    """The rerun state machine (training/rerun.py): disabled, validate_results, report_determinism_stats."""
    check_for_spiky_loss: bool = False
    check_for_large_grads: bool = False
    result_rejected_tracker_filename: Optional[str] = None
    error_injection_rate: int = 0
    """Tests: inject a fault into one step in this many (0: none); --error-injection-type says which."""
    error_injection_type: str = "transient_error"
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: Optional[int] = None
    exit_signal_handler: bool = False
    watchdog_timeout: Optional[float] = None
    """Seconds a step may run before the hang watchdog ends the job (training/watchdog.py)."""
    torch_compile: bool = False
    """torch.compile every transformer layer (default on CUDA)."""

    def __post_init__(self):
        _at_least(self, 1, ("micro_batch_size", "global_batch_size", "train_iters", "train_samples", "seq_length",
                            "eval_interval", "exit_interval"))
        _at_least(self, 0, ("eval_iters",))
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be in [0, 2**32), got {self.seed}")
        if self.watchdog_timeout is not None and not self.watchdog_timeout > 0:
            raise ValueError(f"--watchdog-timeout must be a positive number of seconds, got {self.watchdog_timeout}")
        if self.skip_nan_steps and not self.check_for_nan_in_loss_and_grad:
            raise ValueError("--skip-nan-steps needs the NaN check; drop --no-check-for-nan-in-loss-and-grad")
        self._check_rerun()

    def _check_rerun(self):
        from teratron.training.rerun import ERROR_INJECTION_TYPES, RERUN_MODES

        if self.rerun_mode not in RERUN_MODES:
            raise ValueError(f"--rerun-mode must be one of {', '.join(RERUN_MODES)}, got {self.rerun_mode!r}")
        if self.error_injection_type not in ERROR_INJECTION_TYPES:
            raise ValueError(f"--error-injection-type must be one of {', '.join(ERROR_INJECTION_TYPES)}, "
                             f"got {self.error_injection_type!r}")
        if self.error_injection_rate < 0:
            raise ValueError(f"--error-injection-rate must be 0 (off) or a positive number of steps, "
                             f"got {self.error_injection_rate}")
        checks = self.check_for_nan_in_loss_and_grad or self.check_for_spiky_loss or self.check_for_large_grads
        if self.error_injection_rate and not (self.rerun_mode == "validate_results" and checks):
            raise ValueError("--error-injection-rate injects faults for the result checks of --rerun-mode "
                             "validate_results; use that mode with a check (the NaN check is on by default)")


@dataclass(frozen=True)
class SchedulerConfig:
    """The learning-rate and weight-decay schedule, its lengths in iterations (lr_*_iters) or in
    samples (lr_*_samples, Megatron's sample-based training), one unit throughout (peaks and floors
    are the optimizer's `lr`, `min_lr`, `weight_decay`)."""
    lr_decay_iters: Optional[int] = None
    lr_decay_style: str = "linear"
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_warmup_samples: int = 0
    lr_wsd_decay_samples: Optional[int] = None
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    override_opt_param_scheduler: bool = False
    """On resume, this schedule wins over the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, the checkpoint's schedule wins. With neither, the two must agree (Megatron's rule)."""

    @property
    def unit(self) -> str:
        """What the lengths count: "samples" (lr_decay_samples set) or "iters"."""
        return "samples" if self.lr_decay_samples is not None else "iters"

    def __post_init__(self):
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler both given; "
                             "choose one (this command line's schedule, or the checkpoint's)")
        unit = self.unit
        other = "iters" if unit == "samples" else "samples"
        decay, warmup = getattr(self, f"lr_decay_{unit}"), getattr(self, f"lr_warmup_{unit}")
        if decay is None:
            raise ValueError("the schedule needs lr_decay_iters or lr_decay_samples (default --train-iters or "
                             "--train-samples)")
        mixed = [name for name in (f"lr_decay_{other}", f"lr_warmup_{other}", f"lr_wsd_decay_{other}")
                 if getattr(self, name)]
        if mixed:
            raise ValueError(f"{mixed[0]} with lr_decay_{unit}: the schedule counts in one unit; "
                             f"use {mixed[0].replace(other, unit)}")
        _at_least(self, 1, (f"lr_decay_{unit}",))
        _at_least(self, 0, (f"lr_warmup_{unit}",))
        if self.lr_warmup_fraction is not None and warmup:
            raise ValueError(f"--lr-warmup-fraction and lr_warmup_{unit} both given; choose one")
        if warmup >= decay:
            raise ValueError(f"lr_warmup_{unit} ({warmup}) must be smaller than lr_decay_{unit} "
                             f"({decay}; default --train-{unit})")
        if self.lr_decay_style == "WSD" and getattr(self, f"lr_wsd_decay_{unit}") is None:
            raise ValueError(f"--lr-decay-style WSD needs lr_wsd_decay_{unit} (length of the final decay)")
        if self.start_weight_decay is None or self.end_weight_decay is None:
            raise ValueError(f"--weight-decay-incr-style {self.weight_decay_incr_style} needs "
                             "--start-weight-decay and --end-weight-decay")


@dataclass(frozen=True)
class DataConfig:
    """Where the samples come from and how they are masked."""
    data_path: Optional[tuple] = None
    split: str = "969,30,1"
    train_data_path: Optional[tuple] = None
    valid_data_path: Optional[tuple] = None
    test_data_path: Optional[tuple] = None
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    mid_level_dataset_surplus: float = 0.005
    """Extra share of samples each dataset of a blend builds."""
    mmap_bin_files: bool = True
    num_workers: int = 2
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    sequence_packing: bool = False
    """Documents as samples, packed into rows per DP-balanced step (datasets/sequence_packing.py)."""

    def __post_init__(self):
        from teratron.datasets.utils import parse_and_normalize_split

        if self.mock_data and (self.data_path or self.train_data_path):
            raise ValueError("--mock-data and --data-path/--train-data-path both given; choose one")
        if self.data_path and self.train_data_path:
            raise ValueError("--data-path and --train-data-path both given; use one (per-split paths "
                             "go with --train/valid/test-data-path)")
        parse_and_normalize_split(self.split)  # a bad --split fails here, also with --mock-data
        _at_least(self, 0, ("num_workers", "mid_level_dataset_surplus"))


@dataclass(frozen=True)
class TokenizerConfig:
    """Megatron's tokenizer flags (`teratron.tokenizers.build_tokenizer` reads them)."""
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    vocab_extra_ids: int = 0
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = 1000
    tiktoken_special_tokens: Optional[tuple] = None
    tokenizer_hf_include_special_tokens: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    load: Optional[str] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    async_save: bool = False
    overwrite: bool = False
    """Let --save write into a folder holding another run's checkpoints."""
    allow_tokenizer_change: bool = False
    """Load a checkpoint trained with another tokenizer or vocabulary size (rows padded or trimmed)."""
    exit_on_missing_checkpoint: bool = False
    """Refuse to start when --load holds no checkpoint."""
    ckpt_format: str = "teratron"
    """The layout --save writes: 'teratron' (the default: checksums, model args, tokenizer and RNG
    states recorded) or 'torch_dist' (Megatron-LM's; docs/checkpoints.md)."""

    def __post_init__(self):
        if self.ckpt_format not in ("teratron", "torch_dist"):
            raise ValueError(f"--ckpt-format {self.ckpt_format}: teratron writes its own layout (the default, "
                             "--ckpt-format teratron) or Megatron-LM's (--ckpt-format torch_dist)")
        _at_least(self, 1, ("save_interval",))
        if self.save_interval is not None and self.save is None:
            raise ValueError("--save-interval given without --save; add --save DIR")
        if self.async_save and self.save is None:
            raise ValueError("--async-save given without --save; add --save DIR")
        if self.load is not None and not os.path.isdir(self.load) and os.path.exists(self.load):
            raise ValueError(f"--load {self.load}: not a directory; pass the checkpoint folder")


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    metrics_file: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    progress_bar: bool = True
    log_straggler: bool = False
    straggler_minmax_count: int = 1
    otel_enabled: bool = False
    """OpenTelemetry traces and metrics (training/telemetry.py)."""
    otel_service_name: Optional[str] = None
    otel_span_groups: Optional[str] = None

    def __post_init__(self):
        _at_least(self, 1, ("log_interval", "straggler_minmax_count"))
        span_groups(self.otel_span_groups)  # a bad spec fails at start-up, not at the first span


@dataclass(frozen=True)
class ProfilingConfig:
    """--profile: iterations [profile_step_start, profile_step_end) on profile_ranks."""
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple = (0,)
    profile_dir: Optional[str] = None

    def __post_init__(self):
        if not self.profile:
            return
        start, end = self.profile_step_start, self.profile_step_end
        if start < 1 or end <= start:
            raise ValueError(f"--profile-step-start {start} --profile-step-end {end}: profiling covers iterations "
                             "[start, end); use 1 <= start < end")
        if self.use_pytorch_profiler and self.profile_dir is None:
            raise ValueError("--profile needs --profile-dir or --tensorboard-dir (where the trace goes)")


@dataclass(frozen=True)
class DistributedConfig:
    """The processes: how many, and how they talk (the layout's sizes are the TransformerConfig's)."""
    world_size: int = 1
    data_parallel_size: int = 1
    distributed_backend: Optional[str] = None
    distributed_timeout_minutes: int = 10


@dataclass(frozen=True)
class RunConfig:
    model: GPTModelConfig
    optimizer: OptimizerConfig
    ddp: DistributedDataParallelConfig
    scheduler: SchedulerConfig
    training: TrainingConfig
    data: DataConfig
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    megatron_flags: tuple = ()
    """Megatron-LM flags accepted as teratron's own implementation choices: ((flag, value), ...)
    (training/megatron_flags.py; noted at start-up)."""

    @property
    def transformer(self) -> TransformerConfig:
        return self.model.transformer

    def __post_init__(self):
        t, training, dist_ = self.transformer, self.training, self.distributed
        if (self.model.position_embedding_type == "learned_absolute"
                and self.model.max_position_embeddings < training.seq_length):
            raise ValueError(f"--max-position-embeddings ({self.model.max_position_embeddings}) is smaller than "
                             f"--seq-length ({training.seq_length}); raise it")
        model_parallel = (t.tensor_model_parallel_size * t.pipeline_model_parallel_size
                          * t.context_parallel_size)
        if dist_.world_size != model_parallel * dist_.data_parallel_size:
            raise ValueError(f"the world size ({dist_.world_size} processes) is not divisible by TP "
                             f"({t.tensor_model_parallel_size}) x PP ({t.pipeline_model_parallel_size}) x CP "
                             f"({t.context_parallel_size}) = {model_parallel}; change the sizes or the number "
                             "of processes")
        if t.num_moe_experts is not None:
            ep, pp = t.expert_model_parallel_size, t.pipeline_model_parallel_size
            etp = t.expert_tensor_parallel_size or t.tensor_model_parallel_size
            if dist_.world_size % (etp * ep * pp):
                raise ValueError(f"the world size ({dist_.world_size} processes) is not divisible by expert TP "
                                 f"({etp}) x EP ({ep}) x PP ({pp}) = {etp * ep * pp}; change "
                                 "--expert-model-parallel-size, --expert-tensor-parallel-size or the number of "
                                 "processes")
        self.microbatches()  # the global batch splits into micro-batches over DP
        self._check_run_length()
        self._check_context_parallel()
        self._check_sequence_packing()
        self._check_profiled_range()
        self._check_cuda_graph_loop()
        self._check_fsdp()

    def _check_fsdp(self):
        if self.transformer.init_model_with_meta_device and not self.ddp.shards_with_fsdp2():
            raise ValueError("--init-model-with-meta-device builds the model without values and lets FSDP make each "
                             "rank's shards; add --use-torch-fsdp2 (or --use-megatron-fsdp) or drop it")
        if not self.ddp.shards_with_fsdp2():
            return
        name = "--use-torch-fsdp2" if self.ddp.use_torch_fsdp2 else "--use-megatron-fsdp"
        if self.optimizer.optimizer_cpu_offload:
            raise ValueError(f"--optimizer-cpu-offload with FSDP ({name}): the sharded fp32 parameters are the "
                             "master weights and stay on the device; drop one")
        t = self.transformer
        if t.cuda_graph_impl == "local" or t.enable_cuda_graph:
            raise ValueError(f"{name} with --cuda-graph-impl local: FSDP gathers parameters in hooks the graphs "
                             "would not replay; drop one")

    def _check_run_length(self):
        training = self.training
        if training.train_samples is None:
            return
        iterations = self.microbatches().iterations_within(training.train_samples)
        if training.train_iters != iterations:
            raise ValueError(f"train_iters ({training.train_iters}) must be the whole global batches in "
                             f"train_samples ({training.train_samples}): {iterations}")

    def _check_context_parallel(self):
        """Each CP rank keeps two of 2 x CP equal chunks of a sequence (split further over TP
        under sequence parallelism)."""
        t, seq = self.transformer, self.training.seq_length
        cp = t.context_parallel_size
        parts = 2 * cp * (t.tensor_model_parallel_size if t.sequence_parallel else 1)
        if cp > 1 and seq % parts:
            raise ValueError(f"--seq-length ({seq}) must be a multiple of 2 x CP"
                             f"{' x TP' if t.sequence_parallel else ''} = {parts} under --context-parallel-size {cp}")

    def _check_sequence_packing(self):
        """A packed micro-batch is one row of --seq-length tokens; micro-batches hold different token
        counts, so the loss is the step's per-token mean."""
        if not self.data.sequence_packing:
            return
        if self.training.micro_batch_size != 1:
            raise ValueError(f"--sequence-packing packs each micro-batch into one row; use --micro-batch-size 1 "
                             f"(got {self.training.micro_batch_size})")
        if not self.transformer.calculate_per_token_loss:
            raise ValueError("--sequence-packing needs --calculate-per-token-loss: packed micro-batches hold "
                             "different numbers of tokens")
        if self.training.rampup_batch_size is not None:
            raise ValueError("--sequence-packing with --rampup-batch-size: the packed steps take a fixed number of "
                             "samples; drop one")
        if self.transformer.cuda_graph_impl == "local" or self.transformer.enable_cuda_graph:
            raise ValueError("--sequence-packing with CUDA graphs: a packed step's micro-batch count varies; drop one")

    def _check_profiled_range(self):
        profiling, world_size = self.profiling, self.distributed.world_size
        if not profiling.profile:
            return
        if profiling.profile_step_start > self.training.train_iters:
            raise ValueError(f"--profile-step-start {profiling.profile_step_start} is after the last iteration "
                             f"(--train-iters {self.training.train_iters}); lower it")
        outside = [r for r in profiling.profile_ranks if not 0 <= r < world_size]
        if outside:
            raise ValueError(f"--profile-ranks {' '.join(map(str, outside))}: no such rank in a world of "
                             f"{world_size}; use ranks 0..{world_size - 1}")

    def microbatches(self):
        """The micro-batch calculator of the run (Megatron's, with batch-size ramp-up)."""
        t = self.training
        return build_num_microbatches_calculator(t.global_batch_size, t.micro_batch_size,
                                                 self.distributed.data_parallel_size, t.rampup_batch_size)

    def _check_cuda_graph_loop(self):
        """What the training loop around local CUDA graphs needs; the TransformerConfig checks the model."""
        t = self.transformer
        if (t.cuda_graph_impl if not t.enable_cuda_graph else "local") != "local":
            return
        if self.ddp.overlap_param_gather:
            raise ValueError("--overlap-param-gather with --cuda-graph-impl local: its forward pre-hooks would "
                             "gather parameters only while capturing; drop one")
        if self.transformer.cuda_graph_scope == "full_iteration":
            if self.ddp.overlap_grad_reduce:
                raise ValueError("--overlap-grad-reduce with --cuda-graph-scope full_iteration: the reduction "
                                 "would be launched inside the graph; drop one (the gradients are reduced after "
                                 "the replay)")
            if self.training.rampup_batch_size is not None:
                raise ValueError("--rampup-batch-size with --cuda-graph-scope full_iteration: the graph holds a "
                                 "fixed number of micro-batches; drop one")

    def to_dict(self) -> dict:
        """The description as JSON-able values (what a checkpoint records)."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    return str(value)


# ---------------------------------------------------------------------------------------------
# Flags -> fields: the one table.

# The sections a flag can set by name (a flag sets its namesake field in each of them).
SECTIONS = {
    "transformer": TransformerConfig, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig,
    "scheduler": SchedulerConfig, "training": TrainingConfig, "data": DataConfig,
    "tokenizer": TokenizerConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
    "profiling": ProfilingConfig, "distributed": DistributedConfig, "model": GPTModelConfig,
    "mla": MLATransformerConfig,  # the transformer section of --multi-latent-attention runs
}

# Flags whose field has another name: flag dest -> (section, field, how the value converts).
RENAMED = {
    "norm_epsilon": ("transformer", "layernorm_epsilon", None),
    "swiglu": ("transformer", "gated_linear_unit", None),
    "num_experts": ("transformer", "num_moe_experts", None),
    "decoder_first_pipeline_num_layers": ("transformer", "num_layers_in_first_pipeline_stage", None),
    "decoder_last_pipeline_num_layers": ("transformer", "num_layers_in_last_pipeline_stage", None),
    "accumulate_allreduce_grads_in_fp32": ("ddp", "grad_reduce_in_fp32", None),
    "ddp_bucket_size": ("ddp", "bucket_size", None),
    "ddp_average_in_collective": ("ddp", "average_in_collective", None),
    "untie_embeddings_and_output_weights": ("model", "share_embeddings_and_output_weights", lambda v: not v),
    "use_rope_scaling": ("model", "rope_scaling", None),
    "spec": ("transformer", "gdp_layers", gdp_layers_of_spec),
    "yarn_original_max_position_embeddings": ("mla", "original_max_position_embeddings", None),
    "yarn_beta_fast": ("mla", "beta_fast", None),
    "yarn_beta_slow": ("mla", "beta_slow", None),
}

# Values filled in from others (see `_derived`): field -> what it defaults to.
DERIVED = {
    "transformer.ffn_hidden_size": "4 x hidden, or 8/3 x hidden rounded down to 64 with --swiglu",
    "transformer.num_query_groups": "--num-query-groups with --group-query-attention, else the heads",
    "transformer.activation_func": "SiLU with --swiglu, quick GELU with --quick-geglu, tanh GeLU with --openai-gelu, "
                                 "relu^2 with --squared-relu, else GeLU",
    "transformer.params_dtype": "bf16/fp16 with --bf16/--fp16, else fp32",
    "transformer.virtual_pipeline_model_parallel_size": "from the layout or layers per virtual stage",
    "transformer.sequence_parallel": "off at TP 1",
    "transformer.gradient_accumulation_fusion": "on with CUDA (not with local CUDA graphs)",
    "training.torch_compile": "on with CUDA (not with local CUDA graphs)",
    "training.global_batch_size": "micro-batch x DP",
    "model.max_position_embeddings": "--seq-length",
    "training.train_iters": "--train-samples' whole global batches (with --train-samples)",
    "scheduler.lr_decay_iters": "--train-iters",
    "scheduler.lr_decay_samples": "--train-samples (with --train-samples)",
    "scheduler.start_weight_decay": "--weight-decay (constant increment style)",
    "optimizer.apply_wd_to_qk_layernorm": "also --no-weight-decay-cond-type apply_wd_to_qk_layernorm",
    "checkpoint.ckpt_format": "teratron's layout, or Megatron-LM's with --ckpt-format torch_dist",
    "profiling.profile_dir": "<--tensorboard-dir>/profile",
    "distributed.data_parallel_size": "world size / (TP x PP x CP)",
}

# Flags that are the command's, not the run's (--use-checkpoint-args: where the flags' values come from).
COMMAND_ONLY = ("config", "demo_dir", "demo_samples", "use_checkpoint_args", "use_mp_args_from_checkpoint_args")

# Flags that only feed derived values (see `_derived`).
INPUTS_ONLY = ("group_query_attention", "num_layers_per_virtual_pipeline_stage", "quick_geglu",
               "openai_gelu", "squared_relu", "add_position_embedding", "no_weight_decay_cond_type")

# Flags the RunConfig keeps itself (not in a section).
RUN_FIELDS = ("megatron_flags",)

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr")


@functools.cache
def _field_flags() -> dict:
    """Config field name -> the flag that sets it."""
    by_dest = flags_by_dest()
    names = {f.name: by_dest[f.name] for section in SECTIONS.values() for f in fields(section)
             if f.name in by_dest}
    names.update({fld: by_dest[dest] for dest, (_, fld, _) in RENAMED.items()})
    return names


@functools.cache
def _inverted_fields() -> frozenset:
    """Fields whose flag turns them off: `add_bias_linear=True` is not `--disable-bias-linear=True`."""
    renamed = {dest: fld for dest, (_, fld, _) in RENAMED.items()}
    return frozenset(renamed.get(dest, dest) for dest in inverted_dests()) | {"share_embeddings_and_output_weights"}


def in_flag_terms(message: str) -> str:
    """A config's error message with field names replaced by the flags that set them (a one-word
    name only where it reads as a field: before '=' or ' (')."""
    names = _field_flags()
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.-])({alternatives})(?=[=(]| \()|(?<![\w.-])({alternatives})(?![\w-])")

    def flag_of(match):
        name = match.group(1) or match.group(2)
        valued = match.group(1) and message[match.end()] == "="
        if valued and name in _inverted_fields():
            return name
        return names[name] if match.group(1) or "_" in name else name
    return pattern.sub(flag_of, message)


def run_config_from_args(args, world_size: int, vocab_size: int, cuda: Optional[bool] = None) -> RunConfig:
    """The run description of parsed flags (`parse_train_args`), for `world_size` processes and a
    tokenizer of `vocab_size` ids; `cuda` (default: whether CUDA is available) picks the fast
    defaults. Raises ValueError/NotImplementedError with one line naming the flag."""
    args = _with_hybrid_pattern(args)
    missing = [flag(n) for n in REQUIRED if getattr(args, n) is None]
    if args.train_iters is None and args.train_samples is None:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        raise ValueError(f"missing required flag(s) {', '.join(missing)} (or set them in --config)")
    values = {name: value for name, value in vars(args).items() if name not in COMMAND_ONLY}
    values = {k: tuple(v) if isinstance(v, list) and k not in _LIST_FIELDS else v for k, v in values.items()}
    values.update(_derived(args, world_size, torch.cuda.is_available() if cuda is None else cuda))
    try:
        return _build(values, vocab_size)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(in_flag_terms(str(e))) from None


def build_run_config(args, world_size: Optional[int] = None) -> RunConfig:
    """The run description of parsed flags for this launch: the world size torchrun started
    (unless given), the vocabulary of the tokenizer the flags name."""
    from teratron.tokenizers import build_tokenizer
    from teratron.parallel_state import world_size_from_env

    if world_size is not None:  # a launch planned elsewhere (`teratron bench`), which picks its launcher
        return run_config_from_args(args, world_size, build_tokenizer(args).vocab_size)
    run = run_config_from_args(args, world_size_from_env(), build_tokenizer(args).vocab_size)
    if run.ddp.shards_with_fsdp2() and not launched_by_torchrun():
        name = "--use-torch-fsdp2" if run.ddp.use_torch_fsdp2 else "--use-megatron-fsdp"
        raise ValueError(f"{name} shards over data-parallel ranks with torch.distributed, which one process "
                         "without torchrun does not start; launch with torchrun (--nproc-per-node N) or drop "
                         "the flag")
    return run


# Flags whose list value is a field's list (a per-layer pattern, one coefficient per type).
_LIST_FIELDS = ("moe_layer_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "offload_modules",
                "window_attn_skip_freq", "no_rope_freq", "cp_comm_type", "hierarchical_context_parallel_sizes")


def _section_kwargs(section: str, values: dict, cls=None) -> dict:
    cls = cls or SECTIONS[section]
    kwargs = {f.name: values[f.name] for f in fields(cls) if f.init and f.name in values}
    for dest, (target, fld, convert) in RENAMED.items():
        if target == section and dest in values:
            kwargs[fld] = convert(values[dest]) if convert else values[dest]
    return kwargs


def _transformer_config(values: dict) -> TransformerConfig:
    """MLATransformerConfig with --multi-latent-attention (its YaRN flags left None keep the
    config's defaults, as in Megatron), else TransformerConfig (with --position-embedding-type
    yarn its yarn_* fields from the YaRN flags given, as Megatron sets them)."""
    if not values.get("multi_latent_attention"):
        kwargs = _without_yarn(_section_kwargs("transformer", values))
        if values.get("position_embedding_type") == "yarn":
            kwargs.update({fld: values[dest] for dest, fld in YARN_ARGS.items() if values.get(dest) is not None})
        return TransformerConfig(**kwargs)
    kwargs = _without_yarn({**_section_kwargs("transformer", values, MLATransformerConfig),
                            **_section_kwargs("mla", values)})
    for name in ("rope_type", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        if kwargs.get(name) is None:
            kwargs.pop(name, None)
    return MLATransformerConfig(**kwargs)


def _without_yarn(kwargs: dict) -> dict:
    """The kwargs less plain attention's yarn_* fields, which the YaRN flags set only with
    --position-embedding-type yarn (the flags share their names)."""
    return {k: v for k, v in kwargs.items() if k not in YARN_FIELDS}


def _build(values: dict, vocab_size: int) -> RunConfig:
    transformer = _transformer_config(values)
    model_kwargs = _section_kwargs("model", values)
    model_kwargs.pop("vocab_size", None)  # the flag is the NullTokenizer's; the model takes the tokenizer's
    model = GPTModelConfig(transformer=transformer, vocab_size=vocab_size, **model_kwargs)
    sections = {name: SECTIONS[name](**_section_kwargs(name, values))
                for name in ("optimizer", "ddp", "scheduler", "training", "data", "tokenizer", "checkpoint",
                             "logging", "profiling", "distributed")}
    return RunConfig(model=model, megatron_flags=values.get("megatron_flags") or (), **sections)


def _activation_func(args):
    if args.openai_gelu:
        return openai_gelu
    if args.squared_relu:
        return squared_relu
    return quick_gelu if args.quick_geglu else F.silu if args.swiglu else F.gelu


def _derived(args, world_size: int, cuda: bool) -> dict:
    """Megatron's derived values and teratron's device-dependent defaults."""
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{flag(name)} must be >= 1, got {getattr(args, name)}")
    if world_size % (tp * pp * cp):
        raise ValueError(f"the world size ({world_size} processes) is not divisible by TP ({tp}) x PP ({pp}) "
                         f"x CP ({cp}) = {tp * pp * cp}; change the sizes or the number of processes")
    dp = world_size // (tp * pp * cp)
    out = dict(world_size=world_size, data_parallel_size=dp,
               global_batch_size=args.global_batch_size or args.micro_batch_size * dp,
               max_position_embeddings=args.max_position_embeddings or args.seq_length,
               split=args.split or "969,30,1",
               num_query_groups=args.num_query_groups if args.group_query_attention else None,
               activation_func=_activation_func(args),
               params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
               pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
               deallocate_pipeline_outputs=True,
               virtual_pipeline_model_parallel_size=_virtual_stages(args, pp))
    gated = [name for name in ("swiglu", "quick_geglu") if getattr(args, name)]
    ungated = [name for name in ("openai_gelu", "squared_relu") if getattr(args, name)]
    if ungated and (gated or len(ungated) > 1):
        raise ValueError(f"{flag(ungated[-1])} and {flag((gated + ungated)[0])} each choose the MLP's activation; "
                         "pass one")
    out.update(_run_length(args, out["global_batch_size"], dp))
    if args.quick_geglu:
        if args.swiglu:
            raise ValueError("--quick-geglu and --swiglu each choose the gated MLP's activation; pass one")
        out["swiglu"] = True  # gated, as --swiglu makes it (gated_linear_unit), with quick GELU
    if args.ffn_hidden_size is None:
        out["ffn_hidden_size"] = (int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu
                                  else 4 * args.hidden_size)
        if out["ffn_hidden_size"] < 1:
            raise ValueError(f"--swiglu with --hidden-size {args.hidden_size} rounds the MLP size to 0; "
                             "set --ffn-hidden-size")
    if args.sequence_parallel and tp == 1:
        print("NOTE: --sequence-parallel has no effect with --tensor-model-parallel-size 1; disabled", flush=True)
        out["sequence_parallel"] = False
    _check_megatron_spellings(args, tp)
    out["ckpt_format"] = args.ckpt_format or "teratron"
    out["apply_wd_to_qk_layernorm"] = (args.apply_wd_to_qk_layernorm
                                       or args.no_weight_decay_cond_type == "apply_wd_to_qk_layernorm")
    if args.weight_decay_incr_style == "constant":
        out["start_weight_decay"] = out["end_weight_decay"] = args.weight_decay
    if args.decoupled_lr is not None and args.decoupled_min_lr is None:
        out["decoupled_min_lr"] = args.min_lr
    if args.use_pytorch_profiler and args.profile_dir is None and args.tensorboard_dir is not None:
        out["profile_dir"] = os.path.join(args.tensorboard_dir, "profile")
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "cp_comm_type"):
        value = getattr(args, name)  # one value of a list flag: the scalar the config takes
        if isinstance(value, list) and len(value) == 1:
            out[name] = value[0]
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        out["moe_ffn_hidden_size"] = args.ffn_hidden_size or out.get("ffn_hidden_size")
    graphs = "local" if args.enable_cuda_graph and args.cuda_graph_impl == "none" else args.cuda_graph_impl
    if graphs != "none" and not cuda:
        raise ValueError(NEED_CUDA)
    fast = cuda and graphs != "local"  # fast by default: the fastest correct path of today
    for name in ("torch_compile", "gradient_accumulation_fusion"):
        out[name] = fast if getattr(args, name) is None else getattr(args, name)
    _check_mla_flags(args, out["torch_compile"] and not cuda)
    return out


def _run_length(args, global_batch_size: int, dp: int) -> dict:
    """Megatron's two units of the run and its schedule, never mixed: iterations (--train-iters,
    --lr-*-iters) or samples (--train-samples, --lr-*-samples; the run is its whole global batches)."""
    in_samples = args.train_samples is not None
    if in_samples and args.train_iters is not None:
        raise ValueError("--train-iters and --train-samples both given; choose one (the run's length in "
                         "iterations or in samples)")
    unit, other = ("samples", "iters") if in_samples else ("iters", "samples")
    for name in (f"lr_decay_{other}", f"lr_warmup_{other}", f"lr_wsd_decay_{other}"):
        if getattr(args, name):
            raise ValueError(f"{flag(name)} counts {'iterations' if other == 'iters' else 'samples'} but the run "
                             f"is given in --train-{unit}; use {flag(name.replace(other, unit))}")
    if not in_samples:
        return dict(lr_decay_iters=args.lr_decay_iters or args.train_iters)
    calculator = build_num_microbatches_calculator(global_batch_size, args.micro_batch_size, dp,
                                                   args.rampup_batch_size)
    train_iters = calculator.iterations_within(args.train_samples)
    if train_iters < 1:
        raise ValueError(f"--train-samples ({args.train_samples}) is less than one global batch "
                         f"({calculator.samples_after(1)}); raise it")
    return dict(train_iters=train_iters, lr_decay_samples=args.lr_decay_samples or args.train_samples)


def _check_megatron_spellings(args, tp: int) -> None:
    """Megatron's rules for its older flags that teratron honours."""
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ValueError("--no-position-embedding is Megatron's deprecated flag and needs --position-embedding-type "
                         f"rope (got {args.position_embedding_type}); use --position-embedding-type none or rope")
    if args.padded_vocab_size is not None and args.padded_vocab_size % tp:
        raise ValueError(f"--padded-vocab-size ({args.padded_vocab_size}) must be a multiple of "
                         f"--tensor-model-parallel-size ({tp}): each TP rank holds an equal slice of the vocabulary")


def _check_mla_flags(args, compiled_on_cpu: bool) -> None:
    if args.yarn_correction_range_round_to_int is not None and (
            args.multi_latent_attention or args.position_embedding_type != "yarn"):
        raise ValueError("--yarn-correction-range-round-to-int applies to --position-embedding-type yarn without "
                         "--multi-latent-attention; drop it")
    if args.multi_latent_attention:
        if args.group_query_attention:
            raise ValueError("--group-query-attention does not apply to --multi-latent-attention (its keys and "
                             "values come from one latent); drop one")
        # Inductor (torch 2.13) fails to compile CPU SDPA whose value head differs from the query's.
        if (compiled_on_cpu and args.v_head_dim != args.qk_head_dim + args.qk_pos_emb_head_dim
                and args.attention_backend != "flash"):
            raise ValueError("--torch-compile on the CPU cannot compile multi-latent attention whose --v-head-dim "
                             "differs from --qk-head-dim + --qk-pos-emb-head-dim; add --attention-backend flash "
                             "(pads the heads to one size) or drop --torch-compile")
        return
    yarn = args.position_embedding_type == "yarn"
    changed = [name for name, default in MLA_FLAG_DEFAULTS.items()
               if getattr(args, name) != default and not (yarn and name in YARN_ARGS)]
    if changed:
        alternative = " (or --position-embedding-type yarn)" if all(n in YARN_ARGS for n in changed) else ""
        raise ValueError(f"{', '.join(map(flag, changed))} set without --multi-latent-attention{alternative}; "
                         "add it or drop them")


def _with_hybrid_pattern(args):
    """A hybrid pattern's flags as the config takes them: its layers set --num-layers (Megatron
    ignores a --num-layers that differs, saying so; so does teratron), its '/' depths
    --mtp-num-layers and its '|' the pipeline layout; the config keeps the layers and MTP depths."""
    if args.hybrid_layer_pattern is None:
        return args
    from teratron.models.hybrid import parse_hybrid_pattern, pipeline_layout

    pattern = parse_hybrid_pattern(args.hybrid_layer_pattern)
    changed = dict(hybrid_layer_pattern=pattern.model_pattern, num_layers=pattern.num_layers, is_hybrid_model=True)
    if pattern.mtp_depths:
        if args.mtp_num_layers not in (None, pattern.mtp_depths):
            raise ValueError(f"--mtp-num-layers {args.mtp_num_layers} but --hybrid-layer-pattern has "
                             f"{pattern.mtp_depths} depths after '/'; drop --mtp-num-layers (the pattern sets it)")
        changed["mtp_num_layers"] = pattern.mtp_depths
    if args.num_layers is not None and args.num_layers != pattern.num_layers:
        print(f"NOTE: --hybrid-layer-pattern has {pattern.num_layers} layers; --num-layers {args.num_layers} is "
              "ignored", flush=True)
    layout = pipeline_layout(pattern)
    if layout is not None:
        if args.pipeline_model_parallel_layout is not None:
            raise ValueError("--hybrid-layer-pattern with '|' places the layers on pipeline stages; drop "
                             "--pipeline-model-parallel-layout or the '|'")
        changed["pipeline_model_parallel_layout"] = layout
    return argparse.Namespace(**{**vars(args), **changed})


def _virtual_stages(args, pp):
    """Virtual stages per pipeline rank (None without interleaving) from
    --pipeline-model-parallel-layout, --num-layers-per-virtual-pipeline-stage or the flag itself."""
    layers_per_vp, vpp = args.num_layers_per_virtual_pipeline_stage, args.virtual_pipeline_model_parallel_size
    if layers_per_vp is not None and vpp is not None:
        raise ValueError("--num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size "
                         "both given; choose one")
    if args.pipeline_model_parallel_layout is not None:
        if layers_per_vp is not None:
            raise ValueError("--pipeline-model-parallel-layout and --num-layers-per-virtual-pipeline-stage "
                             "both given; the layout already places every layer, drop the other")
        try:
            layout = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, pp)
            layout.validate_layer_layout(args.num_layers, args.mtp_num_layers)
        except ValueError as e:
            raise ValueError(f"--pipeline-model-parallel-layout: {e}") from None
        from_layout = layout.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp != from_layout:
            raise ValueError(f"--pipeline-model-parallel-layout has {len(layout.stages)} stages = PP {pp} x "
                             f"{from_layout} virtual stages, but --virtual-pipeline-model-parallel-size is "
                             f"{vpp}; drop the flag (the layout sets it)")
        vpp = from_layout
    elif layers_per_vp is not None:
        vpp = _virtual_stages_from_layers(args, pp, layers_per_vp)
    if vpp is not None and vpp < 1:
        raise ValueError(f"--virtual-pipeline-model-parallel-size must be >= 1, got {vpp}")
    if vpp is not None and vpp > 1 and pp < 2:
        raise ValueError(f"{vpp} virtual pipeline stages need --pipeline-model-parallel-size > 1")
    return vpp if vpp is not None and vpp > 1 else None


def _virtual_stages_from_layers(args, pp, layers_per_vp):
    """Virtual stages per rank from the layers of the evenly split ranks (all ranks without
    --decoder-first/last-pipeline-num-layers; the embedding/loss count as a layer when accounted)."""
    name = f"--num-layers-per-virtual-pipeline-stage ({layers_per_vp})"
    if pp < 2:
        raise ValueError(f"{name} needs --pipeline-model-parallel-size > 1")
    if layers_per_vp < 1:
        raise ValueError(f"{name} must be >= 1")
    ends = [n for n in (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
            if n is not None]
    layers = (args.num_layers - sum(ends) + int(args.account_for_embedding_in_pipeline_split)
              + int(args.account_for_loss_in_pipeline_split))
    ranks = pp - len(ends)
    if ranks == 0:
        raise ValueError(f"{name}: every pipeline rank has a fixed layer count (--decoder-first/last-"
                         "pipeline-num-layers); give --virtual-pipeline-model-parallel-size instead")
    if layers < 0 or layers % ranks or (layers // ranks) % layers_per_vp:
        raise ValueError(f"{name} must divide the layers of each evenly split pipeline rank "
                         f"({layers} layers over {ranks} rank(s)); change it or the layer counts")
    return layers // ranks // layers_per_vp


def check_interleaved_schedule(run: RunConfig) -> None:
    """With virtual stages, every step's micro-batch count must be a multiple of the group size.

    A training run checks it (the estimate accepts any count)."""
    t = run.transformer
    if t.virtual_pipeline_model_parallel_size is None:
        return
    pp = t.pipeline_model_parallel_size
    calculator = run.microbatches()
    group = t.microbatch_group_size_per_vp_stage or pp
    if group < pp:
        raise ValueError(f"--microbatch-group-size-per-virtual-pipeline-stage ({group}) must be at least "
                         f"--pipeline-model-parallel-size ({pp})")
    if calculator.is_rampup:
        sizes = range(calculator.start_global_batch_size, run.training.global_batch_size + 1,
                      calculator.batch_size_increment)
    else:
        sizes = [run.training.global_batch_size]
    per_step = calculator.micro_batch_times_data_parallel_size
    for size in sizes:
        if (size // per_step) % group:
            raise ValueError(
                f"the interleaved schedule needs the micro-batches per step to be a multiple of "
                f"--microbatch-group-size-per-virtual-pipeline-stage ({group}; default the PP size), but "
                f"global batch {size} / (micro-batch {run.training.micro_batch_size} x DP "
                f"{run.distributed.data_parallel_size}) = {size // per_step}; change --global-batch-size or the "
                "group size")
