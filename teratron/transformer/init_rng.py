"""Layout-invariant initialisation: the same seed gives the same full model under any layout.

Tensor-parallel layers initialise the full weight and keep their shard, so TP does not change
the weights. Pipeline stages build different subsets of the model, so a shared random stream
would give layer 3 different weights depending on which stage builds it. Instead each component
is built under its own stream, seeded from (the user's `torch.manual_seed`, the component's tag):
"embedding", "layer{global 1-based layer number}", "final_norm", "output_layer" (a tied output
weight on the last stage uses "embedding", so it starts equal to the first stage's embedding).
The default generator is restored afterwards, so building consumes none of the caller's stream.

`build_component(tag, build, meta)` builds a component under its stream and remembers how, so a
component built on the meta device (`init_model_with_meta_device`: no memory, no values) can
be built again, one at a time, with the same values (`rebuild`): FSDP materialises its shards
that way, never holding more than one component in full.
"""

import contextlib
import zlib

import torch


def _devices():
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _component_seed(tag: str) -> int:
    return zlib.crc32(f"{torch.initial_seed()}:{tag}".encode())


@contextlib.contextmanager
def _seeded(seed: int):
    with torch.random.fork_rng(devices=_devices()):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def component_rng(tag: str):
    """Build the component `tag` under a default-RNG stream derived from the current seed."""
    with _seeded(_component_seed(tag)):
        yield


def build_component(tag: str, build, meta: bool = False) -> torch.nn.Module:
    """`build()` under component `tag`'s stream; with `meta`, on the meta device, and the module
    remembers the stream and `build` for `rebuild` (only then: `build` may hold its whole parent)."""
    seed = _component_seed(tag)
    with _seeded(seed), (torch.device("meta") if meta else contextlib.nullcontext()):
        module = build()
    if meta:
        module._component_build = (seed, build)
    return module


def rebuild(module: torch.nn.Module, device) -> torch.nn.Module:
    """A new copy of a `build_component` module with the values it was first built with, on `device`."""
    seed, build = module._component_build
    with _seeded(seed), torch.device(device):
        return build()


def built_components(module: torch.nn.Module) -> list:
    """The outermost `build_component` modules under `module`."""
    found, inside = [], set()
    for name, sub in module.named_modules():
        if hasattr(sub, "_component_build") and not any(name.startswith(p + ".") for p in inside):
            found.append(sub)
            inside.add(name)
    return found
