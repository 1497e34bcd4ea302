"""The process-group grid: which ranks talk to which, for every kind of parallelism.

Megatron Core's `parallel_state` API. The world is a grid of sizes (tp, cp, ep, dp, pp) laid
out in the order string, first name fastest, so with the default "tp-cp-ep-dp-pp"

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))      (ep = 1 on the dense grid)

and TP ranks are adjacent (one node), PP ranks furthest apart. Expert layers use a second grid
over the same ranks with sizes (expert_tp, 1, ep, expert_dp, pp); expert_dp is whatever is left.

When the grid is not initialised every world-size getter returns 1, every rank getter 0 and
every group getter None (a group of one), so one process runs any model without
torch.distributed.
"""

import math
from datetime import timedelta

import torch.distributed as dist

_DIMS = ("tp", "cp", "ep", "dp", "pp")


class RankGenerator:
    """Lists the ranks of every group of one grid (dense or expert)."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str):
        self.sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        names = order.lower().split("-")
        if len(names) != len(set(names)) or not set(names) <= set(_DIMS):
            raise ValueError(f"order {order!r} must name each of {'-'.join(_DIMS)} at most once")
        for name in _DIMS:
            if name not in names:
                if self.sizes[name] != 1:
                    raise ValueError(
                        f"order {order!r} leaves out {name} but its size is {self.sizes[name]}; "
                        f"add {name} to the order"
                    )
                names.append(name)
        self.names = tuple(names)

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group for `token` ("tp", "dp-cp", "tp-pp", ...): ranks varying only along the
        token's dimensions. Members are listed with the order's first dimension fastest."""
        wanted = token.lower().split("-")
        unknown = set(wanted) - set(_DIMS)
        if unknown:
            raise ValueError(f"group token {token!r} names unknown dimensions {sorted(unknown)}")
        sizes = [self.sizes[n] for n in self.names]
        strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
        inside = [i for i, n in enumerate(self.names) if n in wanted]
        outside = [i for i, n in enumerate(self.names) if n not in wanted]
        groups = []
        for outer in _coordinates([sizes[i] for i in outside]):
            base = sum(c * strides[i] for c, i in zip(outer, outside))
            groups.append([
                base + sum(c * strides[i] for c, i in zip(inner, inside))
                for inner in _coordinates([sizes[i] for i in inside])
            ])
        return groups


def _coordinates(sizes):
    """All index tuples of a grid of `sizes`, the first index fastest."""
    for flat in range(math.prod(sizes)):
        coord = []
        for size in sizes:
            coord.append(flat % size)
            flat //= size
        yield tuple(coord)


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The first and last pipeline stage hold the (tied) word embeddings."""
    return pp_ranks[:1] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    return pp_ranks[:1]


# This rank's groups and the global ranks of some of them, keyed by group token.
_GROUPS: dict = {}
_GROUP_RANKS: dict = {}
_VIRTUAL_PIPELINE_RANK = None
_VIRTUAL_PIPELINE_WORLD_SIZE = None
_INITIALIZED = False


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
) -> None:
    """Build every process group of the dense and the expert grid (Megatron Core semantics).

    torch.distributed must be initialised. Every rank creates every group (torch requires it)
    and keeps the ones it belongs to.
    """
    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE, _INITIALIZED
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group() first")
    if _INITIALIZED:
        raise RuntimeError("model parallel is already initialized; call destroy_model_parallel() first")
    if num_distributed_optimizer_instances != 1:
        raise ValueError(
            f"num_distributed_optimizer_instances={num_distributed_optimizer_instances} is not "
            "supported; use 1"
        )
    world_size = dist.get_world_size()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    _check_sizes(world_size, tp, pp, cp, ep, etp, virtual_pipeline_model_parallel_size)
    dense = RankGenerator(tp=tp, ep=1, dp=world_size // (tp * pp * cp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world_size // (etp * ep * pp), pp=pp, cp=1, order=order)

    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_RANK = 0
        _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size
    timeout = timedelta(minutes=distributed_timeout_minutes)
    for key, token in [("dp", "dp"), ("dp_cp", "dp-cp"), ("cp", "cp"), ("tp", "tp"),
                       ("pp", "pp"), ("mp", "tp-pp"), ("tp_cp", "tp-cp"), ("tp_dp", "tp-dp"),
                       ("tp_dp_cp", "tp-dp-cp")]:
        _create(key, dense.get_ranks(token), timeout)
    embedding_ranks = get_embedding_ranks or default_embedding_ranks
    position_ranks = get_position_embedding_ranks or default_position_embedding_ranks
    pp_groups = dense.get_ranks("pp")
    # A rank outside its stage group's embedding ranks still knows them (is_rank_in_embedding_group).
    _create("embd", [embedding_ranks(ranks) for ranks in pp_groups], timeout, pp_groups)
    _create("pos_embd", [position_ranks(ranks) for ranks in pp_groups], timeout, pp_groups)
    for key, token in [("expt_tp", "tp"), ("ep", "ep"), ("expt_dp", "dp"), ("tp_ep", "tp-ep"),
                       ("tp_ep_pp", "tp-ep-pp")]:
        _create(key, expert.get_ranks(token), timeout)
    _INITIALIZED = True


def _check_sizes(world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int, vpp: int | None) -> None:
    for name, size in [("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("context_parallel_size", cp), ("expert_model_parallel_size", ep),
                       ("expert_tensor_parallel_size", etp)]:
        if size < 1:
            raise ValueError(f"{name}={size} must be at least 1")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x "
            f"context ({cp}) parallel sizes = {tp * pp * cp}; change the sizes or the number of ranks"
        )
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by expert tensor ({etp}) x expert ({ep}) x "
            f"pipeline ({pp}) parallel sizes = {etp * ep * pp}; change the expert sizes"
        )
    if vpp is not None and pp < 2:
        raise ValueError(
            "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1, "
            f"got {pp}; unset it or raise the pipeline size"
        )


def _create(key: str, groups: list[list[int]], timeout: timedelta, owners=None) -> None:
    """Create every group (all ranks must); keep this rank's. `owners[i]` are the ranks that
    record `groups[i]`'s members (default: the members themselves)."""
    rank = dist.get_rank()
    for i, ranks in enumerate(groups):
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _GROUPS[key] = group
        if rank in (ranks if owners is None else owners[i]):
            _GROUP_RANKS[key] = list(ranks)


def model_parallel_is_initialized() -> bool:
    return _INITIALIZED


def destroy_model_parallel() -> None:
    """Forget every group (they are not torn down: torch.distributed owns them)."""
    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE, _INITIALIZED
    _GROUPS.clear()
    _GROUP_RANKS.clear()
    _VIRTUAL_PIPELINE_RANK = None
    _VIRTUAL_PIPELINE_WORLD_SIZE = None
    _INITIALIZED = False


def _group(key: str):
    return _GROUPS.get(key) if _INITIALIZED else None


def _size(key: str) -> int:
    group = _group(key)
    return 1 if group is None else dist.get_world_size(group)


def _rank(key: str) -> int:
    group = _group(key)
    return 0 if group is None else dist.get_rank(group)


def _ranks(key: str) -> list[int]:
    """Global ranks of this rank's `key` group ([own rank] or [0] when not initialised)."""
    if _INITIALIZED:
        return list(_GROUP_RANKS[key])
    return [dist.get_rank() if dist.is_initialized() else 0]


# ----- groups -----------------------------------------------------------------------------------

def get_tensor_model_parallel_group():
    return _group("tp")


def get_pipeline_model_parallel_group():
    return _group("pp")


def get_data_parallel_group(with_context_parallel: bool = False):
    return _group("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_group():
    return _group("cp")


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
    return _VIRTUAL_PIPELINE_RANK


def set_virtual_pipeline_model_parallel_rank(rank) -> None:
    global _VIRTUAL_PIPELINE_RANK
    _VIRTUAL_PIPELINE_RANK = rank


def get_virtual_pipeline_model_parallel_world_size():
    return _VIRTUAL_PIPELINE_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size) -> None:
    global _VIRTUAL_PIPELINE_WORLD_SIZE
    _VIRTUAL_PIPELINE_WORLD_SIZE = world_size


def _virtual_stage(vp_stage):
    """The model chunk asked about: `vp_stage` if given, else the current virtual rank."""
    return get_virtual_pipeline_model_parallel_rank() if vp_stage is None else vp_stage


def is_pipeline_first_stage(ignore_virtual: bool = False, vp_stage: int | None = None) -> bool:
    """True on the first pipeline stage (and, unless ignore_virtual, its first model chunk)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None and vpp > 1 and _virtual_stage(vp_stage) != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False, vp_stage: int | None = None) -> bool:
    """True on the last pipeline stage (and, unless ignore_virtual, its last model chunk)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None and vpp > 1 and _virtual_stage(vp_stage) != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True if this rank holds a word embedding (first or last stage); with ignore_virtual=False,
    only for the model chunk that holds it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = get_embedding_global_ranks()
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    first = rank == ranks[0] and is_pipeline_first_stage(False, vp_stage)
    last = rank == ranks[-1] and is_pipeline_last_stage(False, vp_stage)
    return first or last


def is_rank_in_position_embedding_group() -> bool:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank in get_position_embedding_global_ranks()
