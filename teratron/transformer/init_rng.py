"""Layout-invariant initialisation: the same seed gives the same full model under any layout.

Tensor-parallel layers initialise the full weight and keep their shard, so TP does not change
the weights. Pipeline stages build different subsets of the model, so a shared random stream
would give layer 3 different weights depending on which stage builds it. Instead each component
is built under its own stream, seeded from (the user's `torch.manual_seed`, the component's tag):
"embedding", "layer{global 1-based layer number}", "final_norm", "output_layer" (a tied output
weight on the last stage uses "embedding", so it starts equal to the first stage's embedding).
The default generator is restored afterwards, so building consumes none of the caller's stream.
"""

import contextlib
import zlib

import torch


def _devices():
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


@contextlib.contextmanager
def component_rng(tag: str):
    """Build the component `tag` under a default-RNG stream derived from the current seed."""
    seed = zlib.crc32(f"{torch.initial_seed()}:{tag}".encode())
    with torch.random.fork_rng(devices=_devices()):
        torch.manual_seed(seed)
        yield
