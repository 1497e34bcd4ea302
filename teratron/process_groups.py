"""Megatron's module path of ProcessGroupCollection (`core.process_groups_config`).

`ProcessGroupCollection` (the process groups a module uses, passed in rather than looked up),
`get_pg_size` and `get_pg_rank` live with the topology they view: `teratron.topology`. A module
built with an explicit collection does not read global state, so one process can hold models
with different layouts. The collection of the run is `current_topology().pg_collection()`; a
public entry point given no collection, or one with a None group, takes the current topology's
groups through `teratron.topology.resolve_pg_collection`. Once resolved, `None` for a group
means a group of one (no communication).
"""

from teratron.topology import ProcessGroupCollection, get_pg_rank, get_pg_size

__all__ = ["ProcessGroupCollection", "get_pg_rank", "get_pg_size"]
