"""Peak device memory of one rank: model states + the activations the pipeline schedule holds.

    peak allocated = weights + grad buffer + master weights + optimizer states
                     + max(activation peak over the schedule, optimizer-step transients)
                     + WORKSPACE_BYTES
    device memory  = peak allocated * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT_BYTES

"peak allocated" is what `torch.cuda.max_memory_allocated()` reports (the `mem_peak_gib` of
`--metrics-file`); "device memory" is what must fit on the GPU. Model states follow
teratron's optimizer: bf16/fp16 params get fp32 masters (sharded over data parallel by the
distributed optimizer, partly on the host with CPU offload); the DDP grad buffer holds the
param dtype, or fp32 with --accumulate-allreduce-grads-in-fp32 (else the optimizer step makes
fp32 copies of the grads, freed at the next zero_grad). The activation peak walks the
real schedule (`pipeline_parallel.schedule_plan.rank_actions`): 1F1B holds up to pp
micro-batches on the first stage, interleaved 1F1B more.
"""

from dataclasses import dataclass, field

from teratron.estimate.activations import ChunkActivations
from teratron.estimate.params import ChunkParams
from teratron.pipeline_parallel.schedule_plan import rank_actions

GiB = 2**30
# The CUDA context (kernels of torch, cuBLAS, NCCL loaded lazily) lives outside the caching
# allocator: about 0.5 GiB on H100/H200 with CUDA 12.
CUDA_CONTEXT_BYTES = GiB // 2
# Memory the caching allocator reserves beyond what is allocated (block rounding and
# fragmentation); a few percent for a training loop whose shapes repeat every iteration.
ALLOCATOR_RESERVE = 0.05
# cuBLAS/cuBLASLt workspaces, which torch allocates through the caching allocator.
WORKSPACE_BYTES = 64 * 2**20

# fp32 optimizer-state tensors per master element.
_STATES = {"adam": 2, "lion": 1, "muon": 1}


@dataclass(frozen=True)
class Parallelism:
    """Sizes the memory model needs beyond the configs."""

    data_parallel_size: int
    num_microbatches: int

    def expert_data_parallel_size(self, config) -> int:
        dense_ranks = config.tensor_model_parallel_size * config.context_parallel_size * self.data_parallel_size
        return dense_ranks // (config.expert_model_parallel_size * config.expert_tensor_parallel_size)


@dataclass
class StateBytes:
    weights: int = 0
    grads: int = 0
    master_weights: int = 0
    optimizer_states: int = 0
    step_transient: int = 0     # live only from the optimizer step to the next zero_grad
    host: int = 0               # offloaded master weights and states (not on the device)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master_weights + self.optimizer_states


def _states_per_element(optimizer_config, part: str) -> int:
    kind = optimizer_config.optimizer
    if kind == "sgd":
        return 1 if optimizer_config.sgd_momentum > 0 else 0
    if kind == "muon" and part in ("embedding", "output layer", "norms"):
        return 2  # Muon steps only hidden matrices; the rest uses its scalar optimizer (Adam)
    return _STATES[kind]


def state_bytes(config, optimizer_config, ddp_config, par: Parallelism, params: ChunkParams,
                fused_adam: bool = False) -> StateBytes:
    """Model and optimizer states of one rank (params summed over its model chunks). `fused_adam`:
    on-device Adam is torch's fused kernel (CUDA), which needs no temporaries."""
    if ddp_config.shards_with_fsdp2():
        return _fsdp_state_bytes(config, optimizer_config, par, params, fused_adam)
    param_bytes = config.params_dtype.itemsize
    mixed = param_bytes < 4
    grad_bytes = 4 if ddp_config.grad_reduce_in_fp32 else param_bytes
    out = StateBytes(weights=params.total * param_bytes, grads=params.total * grad_bytes)
    distributed = ddp_config.use_distributed_optimizer
    dense_shard = config.context_parallel_size * par.data_parallel_size if distributed else 1
    expert_shard = par.expert_data_parallel_size(config) if distributed else 1
    offloaded = optimizer_config.optimizer_offload_fraction if optimizer_config.optimizer_cpu_offload else 0.0

    groups = []  # master elements per optimizer (dense, expert): they step one after another
    for parts, shard in ((params.dense, dense_shard), (params.expert, expert_shard)):
        masters = sum(parts.values()) / shard
        states = sum(n / shard * _states_per_element(optimizer_config, p) for p, n in parts.items())
        on_device = 1.0 - offloaded
        out.master_weights += int(4 * masters * on_device) if mixed else 0
        out.optimizer_states += int(4 * states * on_device)
        out.host += int(4 * (masters * mixed + states) * offloaded)
        groups.append(masters * on_device)
    if mixed and grad_bytes != 4:
        out.step_transient += int(4 * sum(groups))  # fp32 copies of the masters' grads
    foreach_adam = optimizer_config.optimizer == "muon" or (optimizer_config.optimizer == "adam" and not fused_adam)
    if foreach_adam:
        out.step_transient += int(4 * max(groups))  # foreach Adam's sqrt(v) temporary
    return out


def _fsdp_state_bytes(config, optimizer_config, par: Parallelism, params: ChunkParams, fused_adam: bool):
    """FSDP (distributed/fsdp.py): the fp32 shards are both the params and the master weights, their
    grads fp32 shards, the optimizer states sharded alike; dense parts over DP x CP, experts over
    expert DP. The gathered params of the layers being run are activation-time memory
    (`fsdp_gathered_bytes`)."""
    dense = sum(params.dense.values()) / (config.context_parallel_size * par.data_parallel_size)
    expert = sum(params.expert.values()) / par.expert_data_parallel_size(config)
    states = sum(n * _states_per_element(optimizer_config, p) for p, n in params.dense.items()) / (
        config.context_parallel_size * par.data_parallel_size)
    states += sum(n * _states_per_element(optimizer_config, p) for p, n in params.expert.items()) / (
        par.expert_data_parallel_size(config))
    out = StateBytes(weights=int(4 * (dense + expert)), grads=int(4 * (dense + expert)),
                     optimizer_states=int(4 * states))
    foreach_adam = optimizer_config.optimizer == "muon" or (optimizer_config.optimizer == "adam" and not fused_adam)
    if foreach_adam:
        out.step_transient += int(4 * max(dense, expert))  # foreach Adam's sqrt(v) temporary
    return out


def fsdp_gathered_bytes(config, ddp_config, params: ChunkParams, largest_layer: int) -> int:
    """Unsharded params (params dtype) and one layer's unsharded grads (reduce dtype) that FSDP holds
    while layers run: optim_grads_params gathers a layer at a time (and prefetches the next), plus
    the root unit (embedding, output layer); optim_grads keeps every layer gathered from forward
    to backward."""
    param_bytes = config.params_dtype.itemsize
    grad_bytes = 4 if ddp_config.grad_reduce_in_fp32 else param_bytes
    if ddp_config.fsdp_strategy() == "optim_grads":
        gathered = params.total
    else:
        root = sum(n for part, n in params.dense.items() if part in ("embedding", "output layer"))
        gathered = 2 * largest_layer + root
    return gathered * param_bytes + largest_layer * grad_bytes


def activation_peak(chunks: list, pp_rank: int, pp_size: int, num_microbatches: int,
                    group_size: int) -> tuple:
    """(peak device bytes, most micro-batches in flight, peak host bytes of offloaded
    activations) of this rank over one training step."""
    live = peak = in_flight = most = host = host_peak = 0
    for action in rank_actions(pp_rank, pp_size, len(chunks), num_microbatches, group_size, False):
        chunk: ChunkActivations = chunks[action.chunk]
        if action.kind == "F":
            peak = max(peak, live + chunk.stored + chunk.forward_transient)
            live += chunk.stored
            host += chunk.host
            host_peak = max(host_peak, host)
            in_flight += 1
            most = max(most, in_flight)
        else:
            peak = max(peak, live + chunk.backward_transient)
            live -= chunk.stored
            host -= chunk.host
            in_flight -= 1
    return peak, most, host_peak


@dataclass
class RankMemory:
    states: StateBytes
    activation_peak: int
    microbatches_in_flight: int
    host_activations: int = 0   # offloaded activations at their peak (host memory)
    peak_allocated: int = field(init=False)
    device_memory: int = field(init=False)

    def __post_init__(self):
        busy = max(self.activation_peak, self.states.step_transient)
        self.peak_allocated = self.states.total + busy + WORKSPACE_BYTES
        self.device_memory = int(self.peak_allocated * (1 + ALLOCATOR_RESERVE)) + CUDA_CONTEXT_BYTES
