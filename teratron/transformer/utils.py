"""Small helpers shared by the transformer modules."""

from teratron.process_groups import ProcessGroupCollection


def default_pg_collection(pg_collection):
    """The collection a module uses: the one passed in, else parallel_state's groups (groups of
    one when parallel_state is not initialised)."""
    return ProcessGroupCollection.use_mpu_process_groups() if pg_collection is None else pg_collection
