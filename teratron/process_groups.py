"""ProcessGroupCollection: the process groups a module uses, passed in rather than looked up.

A module built with an explicit collection does not read global state, so one process can hold
models with different layouts. `None` for a group means a group of one (no communication).
"""

from dataclasses import dataclass, fields

import torch.distributed as dist

from teratron import parallel_state

# Field name -> the parallel_state getter that fills it.
_GETTERS = {
    "tp": parallel_state.get_tensor_model_parallel_group,
    "pp": parallel_state.get_pipeline_model_parallel_group,
    "dp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=False),
    "dp_cp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    "cp": parallel_state.get_context_parallel_group,
    "ep": parallel_state.get_expert_model_parallel_group,
    "expt_tp": parallel_state.get_expert_tensor_parallel_group,
    "expt_dp": parallel_state.get_expert_data_parallel_group,
    "tp_ep": parallel_state.get_expert_tensor_and_model_parallel_group,
    "mp": parallel_state.get_model_parallel_group,
    "embd": parallel_state.get_embedding_group,
    "pos_embd": parallel_state.get_position_embedding_group,
    "tp_cp": parallel_state.get_tensor_and_context_parallel_group,
}


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
        """The groups of `parallel_state` (all of them, or only `required_pgs`)."""
        names = [f.name for f in fields(cls)]
        if required_pgs is not None:
            unknown = sorted(set(required_pgs) - set(names))
            if unknown:
                raise ValueError(f"required_pgs names unknown groups {unknown}; choose from {names}")
            names = list(required_pgs)
        return cls(**{name: _GETTERS[name]() for name in names})


def get_pg_size(group=None) -> int:
    """World size of `group`; 1 for None (a group of one)."""
    return 1 if group is None else dist.get_world_size(group)


def get_pg_rank(group=None) -> int:
    """This rank's index in `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)
