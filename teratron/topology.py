"""The parallel layout of this process: one object owns every size, rank and process group.

`parallel_state.initialize_model_parallel(...)` builds a `Topology` and makes it the current
one; `parallel_state`'s getters (Megatron's API) only read it. Until then, and after
`destroy_model_parallel()`, the current topology is the all-ones one: every size 1, every rank
0, every group None (a group of one), so one process runs any model without torch.distributed.

The grid: sizes (tp, cp, ep, dp, pp) laid out in `order`, first name fastest, so with the
default "tp-cp-ep-dp-pp"

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))      (ep = 1 on the dense grid)

and TP ranks are adjacent (one node), PP ranks furthest apart. Expert layers use a second grid
over the same ranks with sizes (expert_tp, 1, ep, expert_dp, pp); expert_dp is whatever is left.

Modules take their groups as a `ProcessGroupCollection` (`Topology.pg_collection()`), passed in.
At a public entry point (GPTModel, a transformer module or parallel layer built on its own, DDP,
the optimizer, the schedules, the TP mappings) a missing collection or group (None) means the
current topology's; `resolve_pg_collection` is the one function that looks it up, and a model
hands the resolved collection down to what it builds. Past that point None is a group of one.
`check_parallel_sizes` compares a config's parallel sizes with the groups a model is built with.
"""

import math
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta

import torch.distributed as dist

@dataclass
class ProcessGroupCollection:
    """Megatron's field names: tensor, pipeline, data (without / with context), context, expert,
    expert-tensor, expert-data, expert tensor+model, model, embedding, position-embedding and
    tensor+context parallel groups, `hcp`: the hierarchical context-parallel groups, one per
    level of hierarchical_context_parallel_sizes (a list; None without them), and the groups of
    hybrid sharding (intra_dp_cp, inter_dist_opt)."""

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    dp_cp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    expt_tp: dist.ProcessGroup | None = None
    expt_dp: dist.ProcessGroup | None = None
    tp_ep: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None
    embd: dist.ProcessGroup | None = None
    pos_embd: dist.ProcessGroup | None = None
    tp_cp: dist.ProcessGroup | None = None
    hcp: list | None = None
    # With num_distributed_optimizer_instances N > 1 (hybrid sharding): the DP x CP ranks of one
    # instance (1/N of dp_cp: sharded over), and the same position in every instance (replicated over).
    intra_dp_cp: dist.ProcessGroup | None = None
    inter_dist_opt: dist.ProcessGroup | None = None

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> "ProcessGroupCollection":
        """Megatron's name for the current topology's groups (all of them, or only `required_pgs`)."""
        names = [f.name for f in fields(cls)]
        if required_pgs is not None:
            unknown = sorted(set(required_pgs) - set(names))
            if unknown:
                raise ValueError(f"required_pgs names unknown groups {unknown}; choose from {names}")
            names = list(required_pgs)
        topology = current_topology()
        return cls(**{name: topology.group(name) for name in names})


def get_pg_size(group=None) -> int:
    """World size of `group`; 1 for None (a group of one)."""
    return 1 if group is None else dist.get_world_size(group)


def get_pg_rank(group=None) -> int:
    """This rank's index in `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


_DIMS = ("tp", "cp", "ep", "dp", "pp")

# Group name -> the dimensions its members vary along, on the dense and on the expert grid, in
# the order every rank creates them (torch.distributed needs the same order on all ranks).
_DENSE_GROUPS = {"dp": "dp", "dp_cp": "dp-cp", "cp": "cp", "tp": "tp", "pp": "pp", "mp": "tp-pp",
                 "tp_cp": "tp-cp", "tp_dp": "tp-dp", "tp_dp_cp": "tp-dp-cp"}
_EXPERT_GROUPS = {"expt_tp": "tp", "ep": "ep", "expt_dp": "dp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp"}
GROUP_NAMES = (*_DENSE_GROUPS, "embd", "pos_embd", *_EXPERT_GROUPS, "hcp", "intra_dp_cp", "inter_dist_opt")


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


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _known(name: str) -> str:
    if name not in GROUP_NAMES:
        raise KeyError(f"unknown group {name!r}; choose from {GROUP_NAMES}")
    return name


@dataclass
class Topology:
    """Sizes of the dense grid (tp, pp, cp, dp) and the expert grid (expert tp, ep, expert dp),
    the virtual pipeline size, and this rank's groups (by `GROUP_NAMES`) with their global ranks.

    Fixed once built, except `virtual_pipeline_model_parallel_rank`: the model chunk a pipeline
    schedule is running, set as it runs (and Megatron's setters of the virtual size and rank).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    order: str = "tp-cp-ep-dp-pp"
    groups: dict = field(default_factory=dict, repr=False)  # name -> this rank's group
    group_ranks: dict = field(default_factory=dict, repr=False)  # name -> its global ranks
    virtual_pipeline_model_parallel_rank: int | None = None

    @classmethod
    def build(cls, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
              virtual_pipeline_model_parallel_size: int | None = None, context_parallel_size: int = 1,
              expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
              order: str = "tp-cp-ep-dp-pp", timeout: timedelta = timedelta(minutes=30),
              get_embedding_ranks=None, get_position_embedding_ranks=None,
              hierarchical_context_parallel_sizes=None, num_distributed_optimizer_instances: int = 1) -> "Topology":
        """Create every group of the dense and the expert grid over all of torch.distributed's
        ranks (every rank must call this, with the same arguments); keep this rank's."""
        world_size = dist.get_world_size()
        tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
        ep = expert_model_parallel_size
        etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
        vpp = virtual_pipeline_model_parallel_size
        _check_sizes(world_size, tp, pp, cp, ep, etp, vpp)
        dense = RankGenerator(tp=tp, ep=1, dp=world_size // (tp * pp * cp), pp=pp, cp=cp, order=order)
        expert = RankGenerator(tp=etp, ep=ep, dp=world_size // (etp * ep * pp), pp=pp, cp=1, order=order)
        topology = cls(tp, pp, vpp, cp, ep, etp, dense.sizes["dp"], expert.sizes["dp"], order,
                       virtual_pipeline_model_parallel_rank=None if vpp is None else 0)
        for name, token in _DENSE_GROUPS.items():
            topology._create(name, dense.get_ranks(token), timeout)
        embedding_ranks = get_embedding_ranks or default_embedding_ranks
        position_ranks = get_position_embedding_ranks or default_position_embedding_ranks
        pp_groups = dense.get_ranks("pp")
        # A rank outside its stage group's embedding ranks still knows them (is_rank_in_embedding_group).
        topology._create("embd", [embedding_ranks(ranks) for ranks in pp_groups], timeout, pp_groups)
        topology._create("pos_embd", [position_ranks(ranks) for ranks in pp_groups], timeout, pp_groups)
        for name, token in _EXPERT_GROUPS.items():
            topology._create(name, expert.get_ranks(token), timeout)
        if hierarchical_context_parallel_sizes:
            topology._create_hierarchical_cp(dense.get_ranks("cp"), list(hierarchical_context_parallel_sizes),
                                             timeout)
        if num_distributed_optimizer_instances > 1:
            topology._create_instances(dense.get_ranks("dp-cp"), num_distributed_optimizer_instances, timeout)
        return topology

    def _create_instances(self, dp_cp_groups: list, instances: int, timeout: timedelta) -> None:
        """Hybrid sharding: each DP x CP group cut into `instances` runs of consecutive ranks
        (intra_dp_cp, sharded over), and the ranks at one position of every run (inter_dist_opt,
        replicated over)."""
        size = len(dp_cp_groups[0])
        if size % instances:
            raise ValueError(f"num_distributed_optimizer_instances={instances} does not divide the data x context "
                             f"parallel size {size}; choose a divisor")
        shard = size // instances
        self._create("intra_dp_cp", [ranks[i:i + shard] for ranks in dp_cp_groups for i in range(0, size, shard)],
                     timeout)
        self._create("inter_dist_opt", [ranks[i::shard] for ranks in dp_cp_groups for i in range(shard)], timeout)

    def _create_hierarchical_cp(self, cp_groups: list, sizes: list, timeout: timedelta) -> None:
        """Megatron's hierarchical CP groups: level 0 runs of sizes[0] consecutive CP ranks, each
        next level the ranks sizes[0] x ... apart (for 'a2a+p2p': a2a inside, p2p between)."""
        if math.prod(sizes) != self.context_parallel_size or min(sizes) < 1:
            raise ValueError(f"hierarchical_context_parallel_sizes {sizes} must multiply to the context-parallel "
                             f"size {self.context_parallel_size}")
        rank, mine, members = dist.get_rank(), [], []
        inner = 1
        for size in sizes:
            for cp_ranks in cp_groups:
                for start in range(len(cp_ranks)):
                    if start % (inner * size) >= inner:
                        continue
                    ranks = [cp_ranks[start + i * inner] for i in range(size)]
                    group = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        mine.append(group)
                        members.append(ranks)
            inner *= size
        self.groups["hcp"], self.group_ranks["hcp"] = mine, members

    def _create(self, name: str, groups: list[list[int]], timeout: timedelta, owners=None) -> None:
        """Create every group (all ranks must); keep this rank's. `owners[i]` are the ranks that
        record `groups[i]`'s members (default: the members themselves)."""
        rank = dist.get_rank()
        for i, ranks in enumerate(groups):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                self.groups[name] = group
            if rank in (ranks if owners is None else owners[i]):
                self.group_ranks[name] = list(ranks)

    @property
    def is_initialized(self) -> bool:
        """True when built over torch.distributed (the all-ones topology has no groups)."""
        return bool(self.groups)

    def group(self, name: str):
        """This rank's `name` group (one of GROUP_NAMES); None for a group of one."""
        return self.groups.get(_known(name))

    def size(self, name: str) -> int:
        return get_pg_size(self.group(name))

    def rank(self, name: str) -> int:
        """This rank's index in its `name` group."""
        return get_pg_rank(self.group(name))

    def global_ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's `name` group ([this rank] for the all-ones topology)."""
        return list(self.group_ranks.get(_known(name), [_global_rank()]))

    def pg_collection(self) -> ProcessGroupCollection:
        """The groups modules take, as Megatron's ProcessGroupCollection."""
        return ProcessGroupCollection(**{f.name: self.group(f.name) for f in fields(ProcessGroupCollection)})

    def _virtual_stage(self, vp_stage: int | None):
        """The model chunk asked about: `vp_stage` if given, else the current virtual rank."""
        return self.virtual_pipeline_model_parallel_rank if vp_stage is None else vp_stage

    def is_pipeline_first_stage(self, ignore_virtual: bool = False, vp_stage: int | None = None) -> bool:
        """True on the first pipeline stage (and, unless ignore_virtual, its first model chunk)."""
        vpp = self.virtual_pipeline_model_parallel_size
        if not ignore_virtual and vpp is not None and vpp > 1 and self._virtual_stage(vp_stage) != 0:
            return False
        return self.rank("pp") == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = False, vp_stage: int | None = None) -> bool:
        """True on the last pipeline stage (and, unless ignore_virtual, its last model chunk)."""
        vpp = self.virtual_pipeline_model_parallel_size
        if not ignore_virtual and vpp is not None and vpp > 1 and self._virtual_stage(vp_stage) != vpp - 1:
            return False
        return self.rank("pp") == self.size("pp") - 1

    def is_rank_in_embedding_group(self, ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
        """True if this rank holds a word embedding (first or last stage); with ignore_virtual=False,
        only for the model chunk that holds it."""
        rank, ranks = _global_rank(), self.global_ranks("embd")
        if rank not in ranks:
            return False
        if ignore_virtual:
            return True
        first = rank == ranks[0] and self.is_pipeline_first_stage(False, vp_stage)
        last = rank == ranks[-1] and self.is_pipeline_last_stage(False, vp_stage)
        return first or last

    def is_rank_in_position_embedding_group(self) -> bool:
        return _global_rank() in self.global_ranks("pos_embd")


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


_current = Topology()


def current_topology() -> Topology:
    """The topology parallel_state.initialize_model_parallel built, else the all-ones one."""
    return _current


def set_current_topology(topology: Topology | None) -> None:
    """Make `topology` current (None: a fresh all-ones topology)."""
    global _current
    _current = Topology() if topology is None else topology


def resolve_pg_collection(pg_collection: ProcessGroupCollection | None = None) -> ProcessGroupCollection:
    """The groups a public entry point uses: `pg_collection` with each missing (None) group
    taken from the current topology; all of the current topology's when it is None."""
    current = current_topology().pg_collection()
    if pg_collection is None:
        return current
    missing = {f.name: getattr(current, f.name) for f in fields(pg_collection)
               if getattr(pg_collection, f.name) is None and getattr(current, f.name) is not None}
    return replace(pg_collection, **missing) if missing else pg_collection


# ModelParallelConfig field -> the group whose size it must equal.
_DENSE_SIZES = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
                "context_parallel_size": "cp"}
_EXPERT_SIZES = {"expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "expt_tp"}


def check_parallel_sizes(config, pg_collection: ProcessGroupCollection) -> None:
    """Raise if a parallel size in `config` differs from the size of the group that drives the
    layers built from it: the config's sizes decide its own checks (heads and groups divisible
    by TP, sequence parallelism on or off), the groups decide the shards. The expert sizes count
    only for a model with experts."""
    checked = dict(_DENSE_SIZES)
    if getattr(config, "num_moe_experts", None):
        checked.update(_EXPERT_SIZES)
    for name, group_name in checked.items():
        size, configured = get_pg_size(getattr(pg_collection, group_name)), getattr(config, name)
        if configured != size:
            raise ValueError(
                f"config.{name}={configured} but the model's {group_name} group has {size} rank(s); "
                f"set {name}={size} or build the model with groups of {configured} rank(s)"
            )
