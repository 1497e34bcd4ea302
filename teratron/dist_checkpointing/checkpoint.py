"""Save and load a whole training state (model chunks, optimizer, RNG, common state) as one
checkpoint folder, synchronously or in the background.

    save_checkpoint(root, iteration, model, optimizer, common, metadata)   -> iteration folder
    start_async_save(...) -> AsyncSave;  save.finalize(blocking)          background writing
    load_checkpoint(checkpoint_dir, model, optimizer, load_optimizer, load_rng) -> common state

Every rank writes its boxes into ROOT/.tmp_iter_N/ (torch.distributed.checkpoint); once all
ranks succeeded, rank 0 adds metadata.json and common.pt and publishes the folder (rename, then
tracker). RNG states are per rank (`rng_state.<global rank>`); they load only into the layout
that saved them.
"""

import os
import random
import shutil
import threading

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from teratron.dist_checkpointing import serialization, storage
from teratron.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from teratron.dist_checkpointing.model_state import is_model_key, model_sharded_items, param_layouts, unwrap
from teratron.dist_checkpointing.optimizer_state import (load_optimizer_common_state, optimizer_common_state,
                                                         optimizer_sharded_items, prepare_for_load)
from teratron.process_groups import ProcessGroupCollection, get_pg_size

RNG_PREFIX = "rng_state."


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None):
    if dist.is_initialized():
        dist.barrier(group=group)


def all_ranks_true(flag: bool, group=None) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def get_rng_state() -> dict:
    from teratron.tensor_parallel import get_cuda_rng_tracker

    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    from teratron.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def parallel_layout(model_chunks) -> dict:
    """The layout of this run, recorded in metadata.json (resume decides on RNG with it)."""
    pg = getattr(unwrap(model_chunks[0]), "pg_collection", None) or ProcessGroupCollection()
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "tensor_model_parallel_size": get_pg_size(pg.tp), "pipeline_model_parallel_size": get_pg_size(pg.pp),
            "virtual_pipeline_model_parallel_size": len(model_chunks) if len(model_chunks) > 1 else None,
            "data_parallel_size": get_pg_size(pg.dp), "context_parallel_size": get_pg_size(pg.cp),
            "expert_model_parallel_size": get_pg_size(pg.ep)}


def sharded_items(model_chunks, optimizer=None, with_rng=True) -> list:
    for chunk in model_chunks:
        # DDP with --overlap-param-gather leaves the step's param all-gathers in flight: until
        # they finish, the slices other data-parallel ranks updated hold the previous step here.
        finish_param_sync = getattr(chunk, "finish_param_sync", None)
        if finish_param_sync is not None:
            finish_param_sync()
    layouts = param_layouts(model_chunks)
    items = model_sharded_items(model_chunks)
    if optimizer is not None:
        items += optimizer_sharded_items(optimizer, layouts)
    if with_rng:
        items.append(ShardedObject(f"{RNG_PREFIX}{_rank()}", get_rng_state()))
    return items


def _describe(model_chunks, optimizer, common, metadata, with_rng):
    """(common state, metadata) with the layout and the optimizer's common state added."""
    common = dict(common or {})
    metadata = {**(metadata or {}), "layout": parallel_layout(model_chunks), "has_optimizer": optimizer is not None,
                "has_rng": with_rng}
    if optimizer is not None:
        common["optimizer"] = optimizer_common_state(optimizer)
    return common, metadata


def _begin(root: str, iteration: int) -> str:
    tmp = storage.temporary_dir(root, iteration)
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    return tmp


def _finish(root, iteration, ok: bool, error, common, metadata) -> str:
    """All ranks: publish when every rank wrote its part, else remove the attempt and raise."""
    tmp = storage.temporary_dir(root, iteration)
    if ok and _rank() == 0:
        try:
            torch.save(common, os.path.join(tmp, storage.COMMON_FILENAME))
            storage.write_metadata(tmp, {"iteration": iteration, **metadata})
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            ok, error = False, e
    if not all_ranks_true(ok):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        cause = f"({serialization.failure_reason(error)})" if error is not None else "on another rank"
        raise OSError(f"--save {root}: writing checkpoint iteration {iteration} failed {cause}; "
                      "the previous checkpoint stays the latest") from None
    if _rank() == 0:
        try:
            storage.publish(root, iteration)
        except Exception as e:  # noqa: BLE001 - the other ranks wait to hear the outcome
            error = e
    if not all_ranks_true(error is None):
        cause = serialization.failure_reason(error) if error is not None else "on rank 0"
        raise OSError(f"--save {root}: publishing checkpoint iteration {iteration} failed ({cause}); the "
                      "previous checkpoint stays the latest") from None
    return storage.iteration_dir(root, iteration)


def save_checkpoint(root, iteration, model_chunks, optimizer=None, common=None, metadata=None,
                    with_rng=True) -> str:
    """Write and publish iteration `iteration` under `root` (a collective); returns its folder."""
    tmp = _begin(root, iteration)
    items, error = None, None
    try:
        items = sharded_items(model_chunks, optimizer, with_rng)
    except Exception as e:  # noqa: BLE001 - the ranks agree before DCP's collectives
        error = e
    if all_ranks_true(error is None):
        try:
            serialization.save(items, tmp)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of it first
            error = e
    elif error is None:
        error = RuntimeError("another rank could not gather its state")
    common, metadata = _describe(model_chunks, optimizer, common, metadata, with_rng)
    return _finish(root, iteration, error is None, error, common, metadata)


def _snapshot(items):
    """CPU copies of the items this rank writes, so training may go on while they are written."""
    out = []
    for item in items:
        if isinstance(item, ShardedTensor):
            if not item.replica:
                out.append(ShardedTensor(item.key, item.data.detach().to("cpu", copy=True), item.global_shape,
                                         item.global_offset))
        else:
            out.append(item)
    return out


_ASYNC_GROUP = None


def _async_group():
    """A gloo group of all ranks for the background writer's collectives, apart from training's."""
    global _ASYNC_GROUP
    if _ASYNC_GROUP is None and dist.is_initialized():
        _ASYNC_GROUP = dist.new_group(backend="gloo")
    return _ASYNC_GROUP


class AsyncSave:
    """A checkpoint being written by a background thread; `finalize` publishes it."""

    def __init__(self, root, iteration, items, common, metadata):
        self.root, self.iteration, self.common, self.metadata = root, iteration, common, metadata
        self.error = None
        group = _async_group()
        self.thread = threading.Thread(target=self._write, args=(items, group), daemon=True,
                                       name=f"teratron-async-save-{iteration}")
        self.thread.start()

    def _write(self, items, group):
        try:
            serialization.save(items, storage.temporary_dir(self.root, self.iteration), process_group=group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported by finalize
            self.error = e

    def finalize(self, blocking: bool) -> bool:
        """A collective: True once published (raises if any rank failed); False while writing."""
        if blocking:
            self.thread.join()
        if not all_ranks_true(not self.thread.is_alive()):
            return False
        _finish(self.root, self.iteration, self.error is None, self.error, self.common, self.metadata)
        return True


def start_async_save(root, iteration, model_chunks, optimizer=None, common=None, metadata=None,
                     with_rng=True) -> AsyncSave:
    """Snapshot the state now and write it in the background (a collective)."""
    _begin(root, iteration)
    items = _snapshot(sharded_items(model_chunks, optimizer, with_rng))
    common, metadata = _describe(model_chunks, optimizer, common, metadata, with_rng)
    return AsyncSave(root, iteration, items, common, metadata)


def load_checkpoint(checkpoint_dir, model_chunks, optimizer=None, load_optimizer=True, load_rng=True) -> tuple:
    """Load the folder into the model chunks (any layout), optionally the optimizer and this
    rank's RNG state; returns (metadata, common state)."""
    metadata = storage.read_metadata(checkpoint_dir)
    common_file = os.path.join(checkpoint_dir, storage.COMMON_FILENAME)
    common = torch.load(common_file, map_location="cpu", weights_only=False) if os.path.isfile(common_file) else {}
    layouts = param_layouts(model_chunks)
    items = model_sharded_items(model_chunks)
    refresh_masters = False
    if optimizer is not None and load_optimizer:
        if not metadata.get("has_optimizer", False):
            raise ValueError(f"--load {checkpoint_dir}: the checkpoint has no optimizer state; add "
                             "--no-load-optim (or --finetune) to load the model only")
        optimizer_items, refresh_masters = prepare_for_load(optimizer, layouts,
                                                            serialization.saved_keys(checkpoint_dir))
        items += optimizer_items
    rng = None
    load_rng = load_rng and metadata.get("has_rng", False)
    if load_rng and metadata.get("layout") == parallel_layout(model_chunks):
        rng = ShardedObject(f"{RNG_PREFIX}{_rank()}", None)
        items.append(rng)
    elif load_rng and _rank() == 0:
        print(f"NOTE: {checkpoint_dir} was saved with another parallel layout; RNG states start fresh",
              flush=True)
    serialization.load(items, checkpoint_dir, unexpected_filter=is_model_key)
    if optimizer is not None and load_optimizer:
        load_optimizer_common_state(optimizer, common["optimizer"], f"--load {checkpoint_dir}")
        if refresh_masters:
            optimizer.reload_model_params()
    if rng is not None:
        set_rng_state(rng.value)
    return metadata, common
