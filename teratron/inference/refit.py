"""Weight refit: copy a live training model's weights into an inference model of another layout,
without going through disk (the building block of RL).

    refit_weights(inference_model, training_chunks)   # a collective: every rank calls it

Both models describe their tensors as a checkpoint does (`dist_checkpointing.model_state`):
every local tensor is one or more boxes of a global tensor named by its one-stage state-dict
key, whatever the TP / PP / VPP / EP layout. Every rank learns which boxes each rank holds (the
training chunks) and needs (the inference model), and all ranks derive the same plan: each
needed box is covered by the distinct held boxes it overlaps (data-parallel replicas hold the
same box), each piece sent by one holder -- the needing rank itself when it holds it, else the
holders in turn. The pieces then move tensor by tensor, point to point over the default group
(NCCL on GPU, gloo on CPU), so at most one tensor's pieces are in flight on a rank.

Vocabulary tensors may be padded to other sizes by the two layouts: as when loading a
checkpoint, rows past the training model's are zeroed and its rows past the inference model's
are not sent. The values arrive in the training dtype and are cast to the inference model's.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from teratron.dist_checkpointing.model_state import VOCAB_KEYS, model_sharded_items
from teratron.dist_checkpointing.serialization import all_gather_objects

_SHOWN = 4  # examples per kind of mismatch in an error message


@dataclass(frozen=True)
class Box:
    """What other ranks need to know of one ShardedTensor."""
    key: str
    global_shape: tuple
    offset: tuple
    sizes: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Piece:
    """A region of global tensor `key` that rank `src` copies from its box `src_box` into rank
    `dst`'s box `dst_box` (indices into each rank's item list)."""
    src: int
    src_box: int
    dst: int
    dst_box: int
    offset: tuple
    sizes: tuple
    dtype: torch.dtype


def refit_weights(inference_model, training_chunks, training_pg_collection=None,
                  inference_pg_collection=None) -> None:
    """Copy the weights of `training_chunks` (this rank's model chunks as `teratron train`
    builds them, DDP-wrapped or not; None or [] on a rank without any) into `inference_model`
    (a GPTModel or a list of chunks; None on a rank without one).

    A collective over all ranks of the default group. The pg collections are the groups each
    model was built with (default: each chunk's own `pg_collection`). Raises ValueError on every
    rank when the two models do not hold the same tensors."""
    training_chunks, inference_chunks = _as_list(training_chunks), _as_list(inference_model)
    for chunk in training_chunks:
        # With --overlap-param-gather the step's param all-gathers may still be in flight.
        finish_param_sync = getattr(chunk, "finish_param_sync", None)
        if finish_param_sync is not None:
            finish_param_sync()
    sources = [i for i in model_sharded_items(training_chunks, training_pg_collection)
               if not i.replica and i.data.numel()]
    targets = [i for i in model_sharded_items(inference_chunks, inference_pg_collection) if i.data.numel()]
    held, needed = zip(*all_gather_objects((_boxes(sources), _boxes(targets))))
    plan = plan_refit(list(held), list(needed))
    held_shapes = _global_shapes(held)
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = _comm_device()
    with torch.no_grad():
        for target in targets:
            _zero_rows_past(target, held_shapes[target.key])
        tag = 0
        for pieces in plan.values():
            _move(pieces, sources, targets, rank, device, tag)
            tag += len(pieces)


def _as_list(model) -> list:
    if model is None:
        return []
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _boxes(items) -> list:
    return [Box(i.key, tuple(i.global_shape), tuple(i.global_offset), tuple(i.data.shape), i.data.dtype)
            for i in items]


def _comm_device() -> torch.device:
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _overlap(offset_a, sizes_a, offset_b, sizes_b):
    """(offset, sizes) of the intersection of two boxes, or None."""
    lo = tuple(max(a, b) for a, b in zip(offset_a, offset_b))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(offset_a, sizes_a, offset_b, sizes_b))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _global_shapes(boxes_per_rank) -> dict:
    return {box.key: box.global_shape for boxes in boxes_per_rank for box in boxes}


def _check_match(held_shapes: dict, needed_shapes: dict) -> None:
    """ValueError naming the tensors the two models do not share (vocabulary tensors may differ
    in rows: their padding)."""
    missing = sorted(set(needed_shapes) - set(held_shapes))
    unexpected = sorted(set(held_shapes) - set(needed_shapes)) if needed_shapes else []
    shapes = sorted(f"{key}: training {held_shapes[key]}, inference {shape}" for key, shape in needed_shapes.items()
                    if key in held_shapes and held_shapes[key] != shape
                    and (key not in VOCAB_KEYS or held_shapes[key][1:] != shape[1:]))
    parts = []
    for found, label in ((missing, "missing from the training model"), (unexpected, "missing from the inference "
                         "model"), (shapes, "with other shapes")):
        if found:
            more = f", ... ({len(found) - _SHOWN} more)" if len(found) > _SHOWN else ""
            parts.append(f"{len(found)} tensors {label}: " + "; ".join(found[:_SHOWN]) + more)
    if parts:
        raise ValueError(f"refit: the inference model does not match the training model ({' | '.join(parts)}); "
                         "build the inference model from the training run's model config")


def plan_refit(held: list, needed: list) -> dict:
    """key -> the pieces that fill every needed box of it, from `held[r]` / `needed[r]` (rank r's
    Boxes). The same on every rank: it depends on the gathered boxes only."""
    held_shapes = _global_shapes(held)
    _check_match(held_shapes, _global_shapes(needed))
    holders = {}  # key -> {(offset, sizes): [(rank, box index), ...]}
    for rank, boxes in enumerate(held):
        for index, box in enumerate(boxes):
            holders.setdefault(box.key, {}).setdefault((box.offset, box.sizes), []).append((rank, index, box.dtype))
    plan, turns = {}, {}
    for dst, boxes in enumerate(needed):
        for dst_box, box in enumerate(boxes):
            covered = 0
            for (offset, sizes), owners in holders[box.key].items():
                region = _overlap(box.offset, box.sizes, offset, sizes)
                if region is None:
                    continue
                mine = [owner for owner in owners if owner[0] == dst]
                if mine:
                    src, src_box, dtype = mine[0]
                else:  # the holders in turn, spreading the sends
                    turn = turns.get((box.key, offset), 0)
                    turns[(box.key, offset)] = turn + 1
                    src, src_box, dtype = owners[turn % len(owners)]
                plan.setdefault(box.key, []).append(Piece(src, src_box, dst, dst_box, *region, dtype))
                covered += math.prod(region[1])
            _check_covered(box, held_shapes[box.key], covered)
    return dict(sorted(plan.items()))


def _check_covered(box: Box, held_shape: tuple, covered: int) -> None:
    """The pieces fill the box, up to the training model's rows of a vocabulary tensor."""
    inside = _overlap(box.offset, box.sizes, (0,) * len(held_shape), held_shape)
    expected = 0 if inside is None else math.prod(inside[1])
    if covered != expected:
        raise ValueError(f"refit: the training model's boxes of {box.key} cover {covered} of the {expected} "
                         f"elements the inference model needs at {box.offset}; its shards do not tile the tensor")


def _zero_rows_past(target, held_shape: tuple) -> None:
    """Rows of a vocabulary box past the training model's vocabulary (its padding) become zeros."""
    if target.key not in VOCAB_KEYS:
        return
    rows = held_shape[0]
    keep = max(0, min(target.data.shape[0], rows - target.global_offset[0]))
    target.data.narrow(0, keep, target.data.shape[0] - keep).zero_()


def _region(item, piece: Piece) -> torch.Tensor:
    """The piece's part of a ShardedTensor's local data."""
    data = item.data
    for dim, (start, length) in enumerate(zip(piece.offset, piece.sizes)):
        data = data.narrow(dim, start - item.global_offset[dim], length)
    return data


def _move(pieces, sources, targets, rank: int, device, first_tag: int) -> None:
    """This rank's part of one tensor's pieces: local copies, sends and receives."""
    ops, received = [], []
    for tag, piece in enumerate(pieces, start=first_tag):
        if piece.src == rank and piece.dst == rank:
            _region(targets[piece.dst_box], piece).copy_(_region(sources[piece.src_box], piece))
        elif piece.src == rank:
            data = _region(sources[piece.src_box], piece).to(device).contiguous()
            ops.append(dist.P2POp(dist.isend, data, piece.dst, tag=tag))
        elif piece.dst == rank:
            buffer = torch.empty(piece.sizes, dtype=piece.dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, piece.src, tag=tag))
            received.append((piece, buffer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for piece, buffer in received:
        _region(targets[piece.dst_box], piece).copy_(buffer)
