"""Sharded state dicts: every local tensor piece knows the global tensor it belongs to.

A rank's checkpoint state is a list of items:

    ShardedTensor(key, data, global_shape, global_offset)  a box of global tensor `key`
    ShardedObject(key, value)                              a picklable value (replicated or
                                                           per-rank, by its key)

`data` is a view into live storage (a parameter, an optimizer state), so loading writes in
place. A rank may hold several boxes of one key: a SwiGLU `linear_fc1` shard is two boxes
([gate_r; up_r] sit at two global offsets), and a distributed-optimizer slice — a flat range of a
parameter — is up to a few boxes per dimension. Boxes that several ranks hold identically
(data-parallel replicas) are written once: torch.distributed.checkpoint de-duplicates items
with the same key and offset.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch

from teratron.tensor_parallel.utils import partition_parts


@dataclass
class ShardedTensor:
    key: str
    data: torch.Tensor
    global_shape: tuple
    global_offset: tuple
    # Vocabulary tensors may be padded to another size by another layout: rows past the saved
    # size load as zeros, saved rows past this size are not read.
    resizable_rows: bool = False
    # A copy of a tensor another rank saves (the last stage's tied output weight): loaded only.
    replica: bool = False
    # `data` is a copy (an FSDP shard in the model's compute dtype): what to run once it is loaded,
    # when the model's values come from it (no optimizer master weights were loaded).
    on_load: Any = None


@dataclass
class ShardedObject:
    key: str
    value: Any
    # Module prefixes whose pickled classes load as inert records (safe_load.ForeignObject).
    foreign: tuple = ()


def flat_boxes(shape, start: int, end: int) -> list:
    """Boxes (offsets, sizes, flat_start) that exactly cover flat elements [start, end) of a
    row-major tensor of `shape`; each box is contiguous in flat order."""
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first_row = start // inner
    if start % inner:  # a partial first row, then the rest
        stop = min(end, (first_row + 1) * inner)
        return _in_row(shape, first_row, start, stop, inner) + flat_boxes(shape, stop, end)
    boxes = []
    last_row = end // inner
    if last_row > first_row:
        boxes.append(((first_row,) + (0,) * (len(shape) - 1), (last_row - first_row,) + tuple(shape[1:]), start))
    if end % inner:
        boxes += _in_row(shape, last_row, last_row * inner, end, inner)
    return boxes


def _in_row(shape, row, start, stop, inner):
    base = row * inner
    return [((row,) + o, (1,) + s, base + f) for o, s, f in flat_boxes(shape[1:], start - base, stop - base)]


def _to_global(key, data, offsets, global_shape, dim, stride, rank, world, flags):
    """Split a local box at the parts of `dim` (`partition_parts`: each split over the ranks
    separately) and place each piece globally."""
    if dim is None or world == 1:
        return [ShardedTensor(key, data, global_shape, tuple(offsets), **flags)]
    parts = partition_parts(global_shape[dim], stride)
    out, lo, hi = [], offsets[dim], offsets[dim] + data.shape[dim]
    local_start = global_start = 0
    for size in parts:
        local = size // world  # this part's rows on every rank
        begin, end = max(lo, local_start), min(hi, local_start + local)
        if begin < end:
            global_offset = list(offsets)
            global_offset[dim] = global_start + rank * local + begin - local_start
            out.append(ShardedTensor(key, data.narrow(dim, begin - offsets[dim], end - begin), global_shape,
                                     tuple(global_offset), **flags))
        local_start, global_start = local_start + local, global_start + size
    return out


def shard_tensor_items(key: str, local: torch.Tensor, dim=None, stride: int = 1, rank: int = 0,
                       world: int = 1, flat_range=None, local_shape=None, resizable_rows=False,
                       replica=False) -> list:
    """ShardedTensors of a tensor-parallel shard `local` split along `dim` (None: replicated)
    with `stride` sub-blocks (see tensor_parallel.utils.shard_tensor).

    With `flat_range=(start, end)`, `local` is only the flat elements [start, end) of a shard of
    shape `local_shape` (a distributed-optimizer slice)."""
    shape = tuple(local.shape) if flat_range is None else tuple(local_shape)
    global_shape = list(shape)
    if dim is not None:
        global_shape[dim] *= world
    global_shape = tuple(global_shape)
    if flat_range is None:
        boxes = [((0,) * len(shape), local)]
    else:
        start, end = flat_range
        boxes = [(o, local[f - start:f - start + math.prod(s)].view(s)) for o, s, f in flat_boxes(shape, start, end)]
    items, flags = [], dict(resizable_rows=resizable_rows, replica=replica)
    for offsets, data in boxes:
        items += _to_global(key, data, offsets, global_shape, dim, stride, rank, world, flags)
    return items
