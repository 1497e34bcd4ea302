"""Megatron Core's `parallel_state` API over the current `teratron.topology.Topology`.

`initialize_model_parallel(...)` builds the topology (every process group of the dense and the
expert grid; see teratron/topology.py for the layout) and makes it current;
`destroy_model_parallel()` goes back to the all-ones topology. Every other function only reads
the current topology: this module keeps no state of its own. `initialize_distributed()` starts
torch.distributed from torchrun's environment (`teratron train`, `generate` and `serve` use it).

When nothing is initialised every world-size getter returns 1, every rank getter 0 and every
group getter None (a group of one), so one process runs any model without torch.distributed.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from teratron.parent_death import exit_with_parent
from teratron.topology import (  # noqa: F401  RankGenerator and the defaults: Megatron's names here
    RankGenerator,
    Topology,
    current_topology,
    default_embedding_ranks,
    default_position_embedding_ranks,
    set_current_topology,
)


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def world_size_from_env() -> int:
    """The number of processes torchrun started (1 without torchrun), known before any rendezvous."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def initialize_distributed(backend: str | None = None, timeout_minutes: int = 10) -> int:
    """Start torch.distributed when torchrun launched us (NCCL with CUDA, else gloo, unless
    `backend` says); returns the world size. Under torchrun each process takes the GPU of its
    LOCAL_RANK, and is killed by the kernel when torchrun dies (`parent_death`), so no rank
    outlives its launcher.

    A process without torchrun runs without torch.distributed: every group is a group of one
    (this module's contract), so nothing needs a rendezvous.
    """
    if not launched_by_torchrun():
        return 1
    exit_with_parent()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"),
                                    timeout=timedelta(minutes=timeout_minutes))
        except RuntimeError as e:
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) and \
                    os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                raise RuntimeError(
                    "the ranks of this torchrun restart could not connect: torchrun's shared store still holds the "
                    "failed attempt's addresses (pytorch/pytorch#135712); run torchrun with "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") from e
            raise
    return dist.get_world_size()


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    hierarchical_context_parallel_sizes=None,
) -> None:
    """Build the topology: every process group of the dense and the expert grid (Megatron Core
    semantics), and make it current.

    torch.distributed must be initialised. Every rank creates every group (torch requires it)
    and keeps the ones it belongs to.
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group() first")
    if model_parallel_is_initialized():
        raise RuntimeError("model parallel is already initialized; call destroy_model_parallel() first")
    if num_distributed_optimizer_instances < 1:
        raise ValueError(f"num_distributed_optimizer_instances={num_distributed_optimizer_instances} must be >= 1")
    set_current_topology(Topology.build(
        tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
        context_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size, order,
        timedelta(minutes=distributed_timeout_minutes), get_embedding_ranks, get_position_embedding_ranks,
        hierarchical_context_parallel_sizes, num_distributed_optimizer_instances,
    ))


def model_parallel_is_initialized() -> bool:
    return current_topology().is_initialized


def destroy_model_parallel() -> None:
    """Forget the topology (its groups are not torn down: torch.distributed owns them)."""
    set_current_topology(None)


def _group(name: str):
    return current_topology().group(name)


def _size(name: str) -> int:
    return current_topology().size(name)


def _rank(name: str) -> int:
    return current_topology().rank(name)


def _ranks(name: str) -> list[int]:
    return current_topology().global_ranks(name)


# ----- groups -----------------------------------------------------------------------------------

def get_tensor_model_parallel_group():
    return _group("tp")


def get_pipeline_model_parallel_group():
    return _group("pp")


def get_data_parallel_group(with_context_parallel: bool = False):
    return _group("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_group():
    return _group("cp")


def get_hierarchical_context_parallel_groups():
    """This rank's hierarchical CP groups, one per level (None without them)."""
    return _group("hcp")


def get_model_parallel_group():
    return _group("mp")


def get_tensor_and_context_parallel_group():
    return _group("tp_cp")


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False):
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_embedding_group():
    return _group("embd")


def get_position_embedding_group():
    return _group("pos_embd")


def get_expert_model_parallel_group():
    return _group("ep")


def get_expert_tensor_parallel_group():
    return _group("expt_tp")


def get_expert_data_parallel_group():
    return _group("expt_dp")


def get_expert_tensor_and_model_parallel_group():
    return _group("tp_ep")


def get_expert_tensor_model_pipeline_parallel_group():
    return _group("tp_ep_pp")


# ----- world sizes and ranks --------------------------------------------------------------------

def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_model_parallel_world_size() -> int:
    return _size("mp")


def get_model_parallel_rank() -> int:
    return _rank("mp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _rank("tp_cp")


def get_expert_model_parallel_world_size() -> int:
    return _size("ep")


def get_expert_model_parallel_rank() -> int:
    return _rank("ep")


def get_expert_tensor_parallel_world_size() -> int:
    return _size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    return _rank("expt_tp")


def get_expert_data_parallel_world_size() -> int:
    return _size("expt_dp")


def get_expert_data_parallel_rank() -> int:
    return _rank("expt_dp")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size("tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank("tp_ep")


# ----- global ranks -----------------------------------------------------------------------------

def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return _ranks("tp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _ranks("dp_cp" if with_context_parallel else "dp")[0]


def get_context_parallel_global_ranks() -> list[int]:
    return _ranks("cp")


def get_pipeline_model_parallel_global_ranks() -> list[int]:
    return _ranks("pp")


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_embedding_global_ranks() -> list[int]:
    return _ranks("embd")


def get_position_embedding_global_ranks() -> list[int]:
    return _ranks("pos_embd")


# ----- pipeline stages --------------------------------------------------------------------------

def get_virtual_pipeline_model_parallel_rank():
    return current_topology().virtual_pipeline_model_parallel_rank


def set_virtual_pipeline_model_parallel_rank(rank) -> None:
    current_topology().virtual_pipeline_model_parallel_rank = rank


def get_virtual_pipeline_model_parallel_world_size():
    return current_topology().virtual_pipeline_model_parallel_size


def set_virtual_pipeline_model_parallel_world_size(world_size) -> None:
    current_topology().virtual_pipeline_model_parallel_size = world_size


def is_pipeline_first_stage(ignore_virtual: bool = False, vp_stage: int | None = None) -> bool:
    """True on the first pipeline stage (and, unless ignore_virtual, its first model chunk)."""
    return current_topology().is_pipeline_first_stage(ignore_virtual, vp_stage)


def is_pipeline_last_stage(ignore_virtual: bool = False, vp_stage: int | None = None) -> bool:
    """True on the last pipeline stage (and, unless ignore_virtual, its last model chunk)."""
    return current_topology().is_pipeline_last_stage(ignore_virtual, vp_stage)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True if this rank holds a word embedding (first or last stage); with ignore_virtual=False,
    only for the model chunk that holds it."""
    return current_topology().is_rank_in_embedding_group(ignore_virtual, vp_stage)


def is_rank_in_position_embedding_group() -> bool:
    return current_topology().is_rank_in_position_embedding_group()
