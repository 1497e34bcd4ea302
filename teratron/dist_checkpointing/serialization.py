"""Save and load lists of sharded items with torch.distributed.checkpoint (DCP).

    save(items, checkpoint_dir)       every rank passes its items; DCP writes one file per rank
    load(items, checkpoint_dir)       fills every item in place, whatever layout saved it
    load_full(checkpoint_dir, keys)   one process: whole global tensors (export, merge)

Before reading, `load` checks the request against the checkpoint's metadata on every rank and
raises one ValueError listing missing keys, shape mismatches and (optionally) keys the model
does not have, so loading another model's checkpoint says what differs. Nothing read runs code
(`safe_load`): .metadata goes through an allow-list, objects and tensors through
torch.load(weights_only=True).
"""

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from teratron.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from teratron.dist_checkpointing.planner import ShardedLoadPlanner, ShardedSavePlanner
from teratron.dist_checkpointing.safe_load import (DCP_METADATA_FILENAME, CheckpointReader, UnsafeCheckpointError,
                                                   read_dcp_metadata, refused_global, unsafe_error)
from teratron.dist_checkpointing.storage import DamagedCheckpointError

_SHOWN = 4  # examples per kind of mismatch in an error message


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns that it "assumes the intent" when torch.distributed is off; here it is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank_errors(error: CheckpointException) -> list:
    """(rank, exception) of each rank that failed; DCP keeps (exception, traceback) pairs."""
    return [(rank, e[0] if isinstance(e, tuple) else e) for rank, e in sorted(error.failures.items())]


def interrupted(error) -> bool:
    """Whether the error is Ctrl+C (DCP catches KeyboardInterrupt with the rest and wraps it)."""
    if isinstance(error, CheckpointException):
        return any(interrupted(e) for _, e in _rank_errors(error))
    return isinstance(error, KeyboardInterrupt)


def failure_reason(error) -> str:
    """One line for an error; DCP's CheckpointException gathers every rank's (exception, traceback)."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {failure_reason(e)}" for rank, e in _rank_errors(error))
    return " ".join(f"{type(error).__name__}: {error}".split())


def _read(checkpoint_dir: str, planner, process_group=None, no_dist: bool = False) -> None:
    """dcp.load of the planner's items; a failed read (a missing or truncated data file) becomes an
    OSError naming the folder instead of DCP's multi-rank traceback, a refused object one line."""
    try:
        with _quiet_single_process():
            dcp.load({}, storage_reader=CheckpointReader(checkpoint_dir), planner=planner,
                     process_group=process_group, no_dist=no_dist or not dist.is_initialized())
    except CheckpointException as e:
        for _, error in _rank_errors(e):
            if isinstance(error, (UnsafeCheckpointError, DamagedCheckpointError)):
                raise error from None
            refused = refused_global(error)  # DCP's own weights_only load of a tensor
            if refused:
                raise unsafe_error(f"{checkpoint_dir} (a tensor in its .distcp files)", refused) from None
        raise OSError(f"{checkpoint_dir}: reading the checkpoint failed ({failure_reason(e)}); it is damaged "
                      "or incomplete") from None


def save(items: list, checkpoint_dir: str, process_group=None, no_dist: bool = False, resolve=None) -> list:
    """Write every rank's items into `checkpoint_dir` (a collective over `process_group`, unless
    `no_dist`: this process writes alone); returns the names of the files written (all ranks').

    With `resolve(item) -> tensor` the items' data are placeholders (meta tensors of the right
    shape and dtype) and each tensor is produced as DCP writes it, in the items' order; each then
    goes to a file of its own (DCP keeps every tensor of a file until the file is done), so one
    tensor at a time is in memory (a streaming import)."""
    writer = dcp.FileSystemWriter(checkpoint_dir, single_file_per_rank=resolve is None, thread_count=1)
    with _quiet_single_process():
        metadata = dcp.save({}, storage_writer=writer, planner=ShardedSavePlanner(items, resolve),
                            process_group=process_group, no_dist=no_dist or not dist.is_initialized())
    # Older PyTorch (2.11) returns the plan's metadata without the storage layout the writer
    # filled in: then read it back from the .metadata file the save just published.
    storage = metadata.storage_data if metadata.storage_data is not None else read_metadata(checkpoint_dir).storage_data
    return sorted({info.relative_path for info in storage.values()} | {DCP_METADATA_FILENAME})


def read_metadata(checkpoint_dir: str):
    try:
        return read_dcp_metadata(os.path.join(checkpoint_dir, DCP_METADATA_FILENAME))
    except FileNotFoundError:
        raise FileNotFoundError(f"{checkpoint_dir}: no torch.distributed.checkpoint metadata (.metadata); "
                                "not a teratron checkpoint folder, or an incomplete one") from None


def _clip_rows(box: ShardedTensor, saved_rows: int) -> ShardedTensor | None:
    """The part of a vocabulary box inside the saved rows; rows past them are zeroed."""
    start, rows = box.global_offset[0], box.data.shape[0]
    keep = max(0, min(rows, saved_rows - start))
    box.data.narrow(0, keep, rows - keep).zero_()
    if keep == 0:
        return None
    shape = (saved_rows,) + tuple(box.global_shape[1:])
    return ShardedTensor(box.key, box.data.narrow(0, 0, keep), shape, box.global_offset)


def _match(items, metadata):
    """(items to read, problems: list of (kind, text))."""
    saved, problems, out = metadata.state_dict_metadata, [], []
    for item in items:
        md = saved.get(item.key)
        if md is None:
            problems.append(("missing", item.key))
        elif isinstance(item, ShardedObject):
            out.append(item)
        elif isinstance(md, BytesStorageMetadata):
            problems.append(("shape", f"{item.key}: saved an object, expected a tensor {tuple(item.global_shape)}"))
        elif tuple(md.size) == tuple(item.global_shape):
            out.append(item)
        elif item.resizable_rows and tuple(md.size[1:]) == tuple(item.global_shape[1:]):
            clipped = _clip_rows(item, md.size[0])
            if clipped is not None:
                out.append(clipped)
        else:
            problems.append(("shape", f"{item.key}: saved {tuple(md.size)}, expected {tuple(item.global_shape)}"))
    return out, problems


def all_gather_objects(obj, process_group=None) -> list:
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, obj, group=process_group)
    return gathered


def _describe(problems) -> str:
    parts = []
    for kind, label in (("missing", "missing from the checkpoint"), ("shape", "with other shapes"),
                        ("unexpected", "in the checkpoint but not in the model")):
        found = sorted({text for k, text in problems if k == kind})
        if found:
            more = f", ... ({len(found) - _SHOWN} more)" if len(found) > _SHOWN else ""
            parts.append(f"{len(found)} keys {label}: " + "; ".join(found[:_SHOWN]) + more)
    return " | ".join(parts)


def load(items: list, checkpoint_dir: str, process_group=None, unexpected_filter=None) -> None:
    """Fill every rank's items from `checkpoint_dir`. `unexpected_filter(key)` selects the saved
    keys some rank must have asked for (e.g. the model's); others are not reported."""
    metadata = read_metadata(checkpoint_dir)
    to_read, problems = _match(items, metadata)
    if unexpected_filter is not None:
        requested = set().union(*all_gather_objects({i.key for i in items}, process_group))
        problems += [("unexpected", key) for key in metadata.state_dict_metadata
                     if unexpected_filter(key) and key not in requested]
    problems = [p for rank_problems in all_gather_objects(problems, process_group) for p in rank_problems]
    if problems:
        raise ValueError(f"checkpoint {checkpoint_dir} does not match: {_describe(problems)}; load it into "
                         "the model it was saved from (same architecture flags)")
    _read(checkpoint_dir, ShardedLoadPlanner(to_read, checkpoint_dir), process_group)


def saved_keys(checkpoint_dir: str) -> dict:
    """key -> global shape (a tuple) or None for an object."""
    return {key: None if isinstance(md, BytesStorageMetadata) else tuple(md.size)
            for key, md in read_metadata(checkpoint_dir).state_dict_metadata.items()}


def load_full(checkpoint_dir: str, select, foreign: tuple = ()) -> dict:
    """Whole global tensors/objects of the saved keys for which `select(key)` is true, read by this
    process alone (no torch.distributed needed); objects' classes under the `foreign` module
    prefixes load as inert records (safe_load.ForeignObject)."""
    items = []
    for key, md in read_metadata(checkpoint_dir).state_dict_metadata.items():
        if not select(key):
            continue
        if isinstance(md, BytesStorageMetadata):
            items.append(ShardedObject(key, None, foreign))
        else:
            data = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            items.append(ShardedTensor(key, data, tuple(md.size), (0,) * len(md.size)))
    if items:
        _read(checkpoint_dir, ShardedLoadPlanner(items, checkpoint_dir), no_dist=True)
    return {i.key: i.data if isinstance(i, ShardedTensor) else i.value for i in items}
