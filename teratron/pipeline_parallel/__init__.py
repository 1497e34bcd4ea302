"""Pipeline parallelism: layer placement (`layout`), p2p between stages, and the schedules."""

from teratron.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
