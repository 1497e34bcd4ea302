"""`estimate_from_run`: memory per GPU and FLOPs of a run description (`RunConfig`), and its
table / JSON forms; `estimate_from_args` for parsed `teratron train` flags.

The flags go through the same run description as `teratron train` (`run_config_from_args`),
so the estimate describes exactly the run `teratron train` would start. FLOPs come from the
training metrics' formula (`training.metrics.num_floating_point_operations`).
"""

import copy
import dataclasses
from dataclasses import dataclass, field

from teratron.estimate.activations import chunk_activations
from teratron.estimate.kernels import kernels_for
from teratron.estimate.memory import (ALLOCATOR_RESERVE, CUDA_CONTEXT_BYTES, WORKSPACE_BYTES, GiB,
                                      Parallelism, RankMemory, activation_peak, fsdp_gathered_bytes, state_bytes)
from teratron.estimate.params import ChunkParams, ModelShape, chunk_params
from teratron.pipeline_parallel.layout import stage_layer_counts


@dataclass
class StageEstimate:
    """One pipeline rank (every TP/CP/DP/EP rank of it holds the same amounts)."""

    pp_rank: int
    params: dict                 # part -> elements on this rank
    layer_activations: dict      # part -> bytes of its first transformer layer, per micro-batch
    chunk_activations: list      # bytes one micro-batch keeps, per model chunk
    loss_transient: int          # logits + loss working set (last stage)
    memory: RankMemory


@dataclass
class Estimate:
    model_parameters: int
    world_size: int
    layout: dict                 # tp, pp, vpp, cp, dp, ep, etp, sequence_parallel, micro-batches
    kernels: dict
    stages: list = field(default_factory=list)
    flops_per_step: float = 0.0
    tokens_per_step: int = 0
    constants: dict = field(default_factory=dict)

    @property
    def peak_allocated(self) -> int:
        return max(stage.memory.peak_allocated for stage in self.stages)

    @property
    def device_memory(self) -> int:
        return max(stage.memory.device_memory for stage in self.stages)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(peak_allocated=self.peak_allocated, device_memory=self.device_memory,
                   flops_per_token=self.flops_per_step / self.tokens_per_step,
                   flops_per_step_per_gpu=self.flops_per_step / self.world_size)
        return out


def resolve_vocab_size(args) -> int:
    """The tokenizer's vocabulary size (the demo's when `teratron train` would run the demo)."""
    if args.tokenizer_type is None and args.demo:
        from teratron.datasets.demo_corpus import DEMO_VOCAB_SIZE
        return DEMO_VOCAB_SIZE
    from teratron.tokenizers import build_tokenizer
    return build_tokenizer(args).vocab_size


def _stage_chunks(config, pp_rank: int) -> list:
    """(layer numbers, pre_process, post_process) of each model chunk of pipeline rank pp_rank."""
    pp = config.pipeline_model_parallel_size
    counts = stage_layer_counts(config, pp)
    chunks = []
    for chunk in range(config.virtual_pipeline_model_parallel_size or 1):
        stage = chunk * pp + pp_rank
        first = sum(counts[:stage]) + 1
        chunks.append((list(range(first, first + counts[stage])), stage == 0, stage == len(counts) - 1))
    return chunks


def _sum_params(parts: list) -> ChunkParams:
    total = ChunkParams()
    for p in parts:
        for name, n in p.dense.items():
            total.add(name, n)
        for name, n in p.expert.items():
            total.add(name, n, is_expert=True)
    total.largest = max((p.largest for p in parts), default=0)  # add() saw whole parts, not parameters
    return total


def _model_parameters(config, shape: ModelShape) -> int:
    single = dataclasses.replace(config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
                                 expert_tensor_parallel_size=1, sequence_parallel=False,
                                 num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                                 pipeline_model_parallel_layout=None, account_for_embedding_in_pipeline_split=False,
                                 account_for_loss_in_pipeline_split=False, pipeline_dtype=None)
    return chunk_params(single, shape, list(range(1, config.num_layers + 1)), True, True).total


def estimate_from_args(args, world_size: int, device_type: str = "cuda") -> Estimate:
    """The estimate for parsed `teratron train` flags on `world_size` GPUs (`device_type`
    decides which kernels' saved tensors are counted and the device-dependent defaults; see
    kernels.py)."""
    from teratron.training.config import run_config_from_args

    args = copy.copy(args)
    # Neither changes memory or FLOPs; `teratron train` requires them, the estimate does not.
    if args.train_samples is None:
        args.train_iters = args.train_iters or 1
    args.lr = 0.0 if args.lr is None else args.lr
    run = run_config_from_args(args, world_size, resolve_vocab_size(args), cuda=device_type == "cuda")
    return estimate_from_run(run, device_type)


def estimate_from_run(run, device_type: str = "cuda") -> Estimate:
    """The estimate of a run description."""
    from teratron.training.metrics import num_floating_point_operations

    config, training, model = run.transformer, run.training, run.model
    shape = ModelShape.of(model, training.seq_length)
    dp = run.distributed.data_parallel_size
    par = Parallelism(data_parallel_size=dp,
                      num_microbatches=training.global_batch_size // (training.micro_batch_size * dp))
    kernels = kernels_for(device_type, config.params_dtype)
    estimate = Estimate(
        model_parameters=_model_parameters(config, shape), world_size=run.distributed.world_size,
        layout=dict(tp=config.tensor_model_parallel_size, pp=config.pipeline_model_parallel_size,
                    vpp=config.virtual_pipeline_model_parallel_size, cp=config.context_parallel_size,
                    dp=par.data_parallel_size, ep=config.expert_model_parallel_size,
                    etp=config.expert_tensor_parallel_size, sequence_parallel=config.sequence_parallel,
                    micro_batch_size=training.micro_batch_size, num_microbatches=par.num_microbatches,
                    params_dtype=str(config.params_dtype).replace("torch.", "")),
        kernels=dataclasses.asdict(kernels),
        flops_per_step=num_floating_point_operations(model, training.seq_length, training.global_batch_size),
        tokens_per_step=training.global_batch_size * training.seq_length,
        constants=dict(CUDA_CONTEXT_BYTES=CUDA_CONTEXT_BYTES, ALLOCATOR_RESERVE=ALLOCATOR_RESERVE,
                       WORKSPACE_BYTES=WORKSPACE_BYTES),
    )
    for pp_rank in range(config.pipeline_model_parallel_size):
        estimate.stages.append(_stage_estimate(config, run.optimizer, run.ddp, par, kernels, shape,
                                               training.micro_batch_size, pp_rank, training.torch_compile))
    return estimate


def _stage_estimate(config, optimizer_config, ddp_config, par, kernels, shape, micro_batch_size, pp_rank,
                    compiled):
    chunks = _stage_chunks(config, pp_rank)
    params = _sum_params([chunk_params(config, shape, layers, pre, post) for layers, pre, post in chunks])
    acts = [chunk_activations(config, kernels, shape, micro_batch_size, layers, pre, post, compiled)
            for layers, pre, post in chunks]
    for act in acts:  # a parameter's own grad lives until the DDP hook adds it to the buffer
        act.backward_transient = max(act.backward_transient + params.largest * config.params_dtype.itemsize,
                                     act.loss_backward_transient)
    if ddp_config.shards_with_fsdp2():  # the gathered layers sit beside the activations
        largest_layer = max((chunk_params(config, shape, [n], False, False).total
                             for layers, _, _ in chunks for n in layers), default=0)
        gathered = fsdp_gathered_bytes(config, ddp_config, params, largest_layer)
        for act in acts:
            act.forward_transient += gathered
            act.backward_transient += gathered
    group_size = config.microbatch_group_size_per_vp_stage or config.pipeline_model_parallel_size
    peak, in_flight, host = activation_peak(acts, pp_rank, config.pipeline_model_parallel_size,
                                            par.num_microbatches, group_size)
    memory = RankMemory(states=state_bytes(config, optimizer_config, ddp_config, par, params, kernels.fused_adam),
                        activation_peak=peak, microbatches_in_flight=in_flight, host_activations=host)
    first_layer = next((a.layers[0] for a in acts if a.layers), {})
    return StageEstimate(pp_rank=pp_rank, params={**params.dense, **params.expert},
                         layer_activations=first_layer, chunk_activations=[a.stored for a in acts],
                         loss_transient=max(a.forward_transient for a in acts), memory=memory)


def _gib(n) -> str:
    return f"{n / GiB:.2f}"


def format_table(estimate: Estimate) -> str:
    """The human-readable table: one column per pipeline stage."""
    lay = estimate.layout
    rows = [("params per GPU (M)", None)]
    parts = sorted({p for s in estimate.stages for p in s.params})
    rows += [(f"  {p}", [f"{s.params.get(p, 0) / 1e6:.1f}" for s in estimate.stages]) for p in parts]
    rows.append(("  total", [f"{sum(s.params.values()) / 1e6:.1f}" for s in estimate.stages]))
    rows.append(("model states (GiB)", None))
    for name in ("weights", "grads", "master_weights", "optimizer_states"):
        rows.append((f"  {name.replace('_', ' ')}", [_gib(getattr(s.memory.states, name)) for s in estimate.stages]))
    rows.append(("activations, first layer (MiB / micro-batch)", None))
    layer_parts = list(dict.fromkeys(p for s in estimate.stages for p in s.layer_activations))
    rows += [(f"  {p}", [f"{s.layer_activations.get(p, 0) / 2**20:.1f}" for s in estimate.stages])
             for p in layer_parts]
    rows += [
        ("activations per micro-batch (GiB)", [_gib(sum(s.chunk_activations)) for s in estimate.stages]),
        ("micro-batches in flight", [str(s.memory.microbatches_in_flight) for s in estimate.stages]),
        ("logits + loss working set (GiB)", [_gib(s.loss_transient) for s in estimate.stages]),
        ("activation peak incl. loss (GiB)", [_gib(s.memory.activation_peak) for s in estimate.stages]),
        ("optimizer-step transient (GiB)", [_gib(s.memory.states.step_transient) for s in estimate.stages]),
        ("host (offloaded) (GiB)", [_gib(s.memory.states.host + s.memory.host_activations)
                                    for s in estimate.stages]),
        ("PEAK ALLOCATED (GiB)", [_gib(s.memory.peak_allocated) for s in estimate.stages]),
        ("device memory (GiB)", [_gib(s.memory.device_memory) for s in estimate.stages]),
    ]
    width = max(len(name) for name, _ in rows) + 2
    header = "".ljust(width) + "".join(f"{'stage ' + str(s.pp_rank):>12}" for s in estimate.stages)
    lines = [
        f"teratron estimate: {estimate.model_parameters / 1e9:.3f} B parameters, {lay['params_dtype']}; "
        f"TP {lay['tp']} x PP {lay['pp']} x CP {lay['cp']} x DP {lay['dp']} (EP {lay['ep']}) = "
        f"{estimate.world_size} GPUs; micro-batch {lay['micro_batch_size']}, "
        f"{lay['num_microbatches']} micro-batches per step",
        header,
    ]
    for name, values in rows:
        lines.append(name.ljust(width) + ("" if values is None else "".join(f"{v:>12}" for v in values)))
    lines += [
        f"FLOPs per step {estimate.flops_per_step:.4g} ({estimate.flops_per_step / estimate.tokens_per_step:.4g} "
        f"per token, {estimate.flops_per_step / estimate.world_size:.4g} per GPU)",
        "peak allocated = torch.cuda.max_memory_allocated (mem_peak_gib); device memory adds "
        f"{ALLOCATOR_RESERVE:.0%} allocator reserve and {CUDA_CONTEXT_BYTES / GiB:.1f} GiB CUDA context",
    ]
    return "\n".join(lines)


def check_fits(run, device_type: str) -> None:
    """Refuse, before anything is allocated, a run whose estimated peak memory per process is
    larger than this machine's memory per process (the GPU's, or the host's shared by the local
    ranks on CPU). A run the estimate does not model (the reference attention path) is let
    through."""
    import os

    import torch

    from teratron.estimate.activations import NotModelled

    try:
        estimate = estimate_from_run(run, device_type)
    except NotModelled:
        return
    if device_type == "cuda":
        needed, available = estimate.device_memory, torch.cuda.get_device_properties(0).total_memory
        where = f"the GPU has {_gib(available)} GiB"
    else:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        needed = estimate.peak_allocated
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_ranks
        where = f"the host has {_gib(available)} GiB per process"
    if needed > available:
        raise ValueError(f"the run needs about {_gib(needed)} GiB per process (teratron estimate) but {where}; "
                         "shrink the model or the micro-batch, or add parallelism (--tensor-model-parallel-size, "
                         "--pipeline-model-parallel-size, --use-distributed-optimizer)")
