"""ProcessGroupCollection: the process groups a module uses, passed in rather than looked up.

A module built with an explicit collection does not read global state, so one process can hold
models with different layouts. The collection of the run is a view of its topology
(`teratron.topology.current_topology().pg_collection()`); a public entry point given no
collection, or one with a None group, takes the current topology's groups through
`teratron.topology.resolve_pg_collection`. Once resolved, `None` for a group means a group of
one (no communication).
"""

from dataclasses import dataclass, fields

import torch.distributed as dist


@dataclass
class ProcessGroupCollection:
    """Megatron's field names: tensor, pipeline, data (without / with context), context, expert,
    expert-tensor, expert-data, expert tensor+model, model, embedding, position-embedding and
    tensor+context parallel groups."""

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

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> "ProcessGroupCollection":
        """Megatron's name for the current topology's groups (all of them, or only `required_pgs`)."""
        from teratron.topology import current_topology  # topology builds collections: it imports this module

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
