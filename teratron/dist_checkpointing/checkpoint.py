"""Save and load a whole training state (model chunks, optimizer, RNG, common state) as one
checkpoint folder, synchronously or in the background.

    save_checkpoint(root, iteration, model, optimizer, common, metadata)   -> iteration folder
    start_async_save(...) -> AsyncSave;  save.finalize(blocking)          background writing
    load_checkpoint(checkpoint_dir, model, optimizer, load_optimizer, load_rng) -> common state

A state holding NaN/Inf is refused before anything is written (NonFiniteStateError on every
rank). Every rank writes its boxes into ROOT/.tmp_iter_N/ (torch.distributed.checkpoint) and
checksums a share of the files written; once all ranks succeeded, rank 0 adds common.pt and
metadata.json (which records every file's size and sha256) and publishes the folder (rename,
then tracker). Loading checks those checksums first, each rank a share. RNG states are per rank
(`rng_state.<global rank>`, tensors and plain data); they load only into the layout that saved
them.
"""

import json
import os
import random
import re
import shutil
import threading

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from teratron.dist_checkpointing import megatron_format, serialization, storage
from teratron.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from teratron.dist_checkpointing.model_state import is_model_key, model_sharded_items, param_layouts, unwrap
from teratron.dist_checkpointing.optimizer_state import (load_optimizer_common_state, optimizer_common_state,
                                                         optimizer_sharded_items, prepare_for_load,
                                                         report_fresh_states)
from teratron.dist_checkpointing.safe_load import read_common_state
from teratron.process_groups import ProcessGroupCollection, get_pg_size

RNG_PREFIX = "rng_state."
_DCP_FILE = re.compile(r"__(\d+)_")  # DCP names rank r's files __<r>_<n>.distcp


class NonFiniteStateError(ValueError):
    """The model or optimizer state holds NaN/Inf: it is not saved."""


def _rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


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
    """This rank's RNG states as tensors and plain data (numpy's key array as a tensor)."""
    from teratron.tensor_parallel import get_cuda_rng_tracker

    algorithm, keys, *position = np.random.get_state()
    return {"random": random.getstate(), "numpy": (algorithm, torch.from_numpy(keys.astype(np.int64)), *position),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    """Restore get_rng_state's states (older checkpoints hold numpy's keys as an array)."""
    from teratron.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    algorithm, keys, *position = state["numpy"]
    np.random.set_state((algorithm, np.asarray(keys, dtype=np.uint32), *position))
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


def _non_finite_key(items):
    """The key of one of this rank's floating-point tensors that holds NaN/Inf, or None."""
    by_device = {}
    for item in items:
        if isinstance(item, ShardedTensor) and item.data.is_floating_point() and item.data.numel():
            by_device.setdefault(item.data.device, []).append(item)
    for boxes in by_device.values():
        # A tensor's min and max show any NaN or Inf in it, without a temporary of its size;
        # one host sync per device. (fp8 has no min/max kernels on every device: upcast it.)
        extremes = torch.stack([torch.stack([d.amin(), d.amax()]).float() for d in
                                (b.data.float() if b.data.element_size() == 1 else b.data for b in boxes)])
        finite = torch.isfinite(extremes).all(dim=1)
        if not bool(finite.all()):
            return boxes[int((~finite).nonzero()[0])].key
    return None


def check_finite(items, root: str, iteration: int) -> None:
    """A collective: NonFiniteStateError on every rank when any rank's items hold NaN/Inf."""
    key = _non_finite_key(items)
    if not all_ranks_true(key is None):
        raise NonFiniteStateError(f"iteration {iteration}: the model or optimizer state holds NaN/Inf "
                                  f"({key or 'on another rank'}), so it is not saved to --save {root}, whose "
                                  "latest checkpoint stays as it was; lower --lr, check the data, or resume from "
                                  "that checkpoint")


def _begin(root: str, iteration: int) -> str:
    tmp = storage.temporary_dir(root, iteration)
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    return tmp


def _share(names: list, group=None) -> list:
    """The files this rank checksums: those it wrote itself, the others spread over the ranks."""
    rank, world = _rank(group), _world_size(group)
    owners = [int(m.group(1)) if (m := _DCP_FILE.match(name)) else i for i, name in enumerate(names)]
    return [name for name, owner in zip(names, owners) if owner % world == rank]


def _record_files(folder: str, names: list, group=None) -> dict:
    """A collective: name -> size and sha256 of every file, each rank checksumming its share."""
    share, error = {}, None
    try:
        share = {name: storage.file_record(os.path.join(folder, name)) for name in _share(names, group)}
    except OSError as e:
        error = f"checksumming {e.filename}: {e.strerror}"
    records, errors = {}, []
    for rank_share, rank_error in serialization.all_gather_objects((share, error), group):
        records.update(rank_share)
        errors += [rank_error] if rank_error else []
    if errors:
        raise OSError(errors[0])
    return records


def _write(items, tmp: str, group=None):
    """A collective: DCP-write every rank's items, then checksum the files. Returns (the files'
    records, or None when any rank failed; this rank's own error, if any)."""
    try:
        written, error = serialization.save(items, tmp, process_group=group), None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of it first
        written, error = None, e
    if not all_ranks_true(error is None, group):
        return None, error
    try:
        return _record_files(tmp, written, group), None
    except OSError as e:
        return None, e


def verify_checkpoint(checkpoint_dir: str, metadata: dict, group=None) -> None:
    """A collective: every file metadata.json records has its size and sha256 (each rank checks a
    share); one DamagedCheckpointError on every rank naming a file that does not."""
    error = None
    try:
        storage.verify_files(checkpoint_dir, metadata, _share(sorted(metadata.get("files") or {}), group))
    except storage.DamagedCheckpointError as e:
        error = str(e)
    errors = [e for e in serialization.all_gather_objects(error, group) if e]
    if errors:
        raise storage.DamagedCheckpointError(errors[0])


def _finish(root, iteration, files, error, common, metadata, ckpt_format="teratron") -> str:
    """All ranks: publish when every rank wrote its part (`files` are their records), else remove
    the attempt and raise."""
    tmp = storage.temporary_dir(root, iteration)
    ok = files is not None
    if ok and _rank() == 0:
        try:
            if ckpt_format == "torch_dist":  # the common state went into the DCP files
                storage.replace_file(os.path.join(tmp, storage.METADATA_FILENAME),
                                     json.dumps(megatron_format.megatron_metadata()))
            else:
                common_file = os.path.join(tmp, storage.COMMON_FILENAME)
                torch.save(common, common_file)
                files = {**files, storage.COMMON_FILENAME: storage.file_record(common_file)}
                storage.write_metadata(tmp, {"iteration": iteration, **metadata, "files": files})
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            ok, error = False, e
    if not all_ranks_true(ok):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        if serialization.interrupted(error):  # Ctrl+C while saving: an interruption, not a failed save
            raise KeyboardInterrupt
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


def _items_of_every_rank(model_chunks, optimizer, with_rng):
    """(this rank's items, None), or (None, this rank's error or None) when any rank failed."""
    items, error = None, None
    try:
        items = sharded_items(model_chunks, optimizer, with_rng)
    except Exception as e:  # noqa: BLE001 - the ranks agree before DCP's collectives
        error = e
    return (items, None) if all_ranks_true(error is None) else (None, error)


def _as_megatron(items, model_chunks, optimizer, common, metadata, iteration) -> list:
    """Items under Megatron-LM's names, and (rank 0) its common state as the object it reads."""
    stacking = megatron_format.stacking(model_chunks)
    items = megatron_format.to_megatron_items(items, **stacking, hybrid=megatron_format.hybrid_layout(model_chunks))
    if _rank() == 0:
        items += megatron_format.extra_states(**stacking, **megatron_format.mtp_layout(model_chunks))
        state = megatron_format.megatron_common_state(common, metadata, iteration, optimizer)
        items.append(ShardedObject(megatron_format.COMMON_STATE_KEY + "/shard_0_1", [state]))
    return items


def save_checkpoint(root, iteration, model_chunks, optimizer=None, common=None, metadata=None,
                    with_rng=True, ckpt_format="teratron") -> str:
    """Write and publish iteration `iteration` under `root` (a collective); returns its folder.
    `ckpt_format` 'torch_dist': Megatron-LM's layout (`megatron_format`; no RNG states)."""
    megatron = ckpt_format == "torch_dist"
    items, error = _items_of_every_rank(model_chunks, optimizer, with_rng and not megatron)
    common, metadata = _describe(model_chunks, optimizer, common, metadata, with_rng and not megatron)
    files = None
    if items is not None:
        check_finite(items, root, iteration)
        if megatron:
            items = _as_megatron(items, model_chunks, optimizer, common, metadata, iteration)
        files, error = _write(items, _begin(root, iteration))
    return _finish(root, iteration, files, error, common, metadata, ckpt_format)


def save_model_tensors(output: str, iteration: int, tensors: dict, common: dict, metadata: dict,
                       side_files_of: str | None = None) -> str:
    """Write whole model tensors (key -> tensor) as iteration `iteration` of the NEW save directory
    `output`, one process, no optimizer or RNG state: what `teratron merge` and the GPT <-> hybrid
    translation write. It is written aside and renamed into place (nothing left behind on error);
    `metadata` gets the iteration and the files' checksums; the Hugging Face side files of the
    checkpoint folder `side_files_of` are carried over. Returns the iteration folder."""
    if os.path.exists(output):
        raise FileExistsError(f"{output}: already exists; write into a new folder")
    staging = storage.staging_dir(output)
    try:
        tmp = storage.temporary_dir(staging, iteration)
        os.makedirs(tmp)
        items = [ShardedTensor(key, t.contiguous(), tuple(t.shape), (0,) * t.dim()) for key, t in tensors.items()]
        serialization.save(items, tmp, no_dist=True)
        torch.save(common, os.path.join(tmp, storage.COMMON_FILENAME))
        storage.write_metadata(tmp, {"iteration": iteration, **metadata, "files": storage.record_files(tmp)})
        storage.publish(staging, iteration)
        hf_side = side_files_of and os.path.join(storage.checkpoint_root(side_files_of), storage.HF_DIRNAME)
        if hf_side and os.path.isdir(hf_side):
            shutil.copytree(hf_side, os.path.join(staging, storage.HF_DIRNAME))
        os.rename(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return storage.iteration_dir(output, iteration)


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


def _async_group(timeout=None):
    """A gloo group of all ranks for the background writer's collectives, apart from training's;
    its collectives give up after `timeout` (the run's --distributed-timeout-minutes; None: torch's
    gloo default)."""
    global _ASYNC_GROUP
    if _ASYNC_GROUP is None and dist.is_initialized():
        _ASYNC_GROUP = dist.new_group(backend="gloo", timeout=timeout)
    return _ASYNC_GROUP


class AsyncSave:
    """A checkpoint being written by a background thread; `finalize` publishes it."""

    def __init__(self, root, iteration, items, common, metadata, ckpt_format="teratron", timeout=None):
        self.root, self.iteration, self.common, self.metadata = root, iteration, common, metadata
        self.ckpt_format = ckpt_format
        self.files, self.error = None, None
        group = _async_group(timeout)
        self.thread = threading.Thread(target=self._write, args=(items, group), daemon=True,
                                       name=f"teratron-async-save-{iteration}")
        self.thread.start()

    def _write(self, items, group):
        self.files, self.error = _write(items, storage.temporary_dir(self.root, self.iteration), group)

    def finalize(self, blocking: bool) -> bool:
        """A collective: True once published (raises if any rank failed); False while writing."""
        if blocking:
            self.thread.join()
        if not all_ranks_true(not self.thread.is_alive()):
            return False
        _finish(self.root, self.iteration, self.files, self.error, self.common, self.metadata, self.ckpt_format)
        return True


def start_async_save(root, iteration, model_chunks, optimizer=None, common=None, metadata=None,
                     with_rng=True, ckpt_format="teratron", timeout=None) -> AsyncSave:
    """Snapshot the state now and write it in the background (a collective); `timeout` bounds the
    background writer's collectives (a timedelta; the first async save of a process sets it)."""
    megatron = ckpt_format == "torch_dist"
    items = sharded_items(model_chunks, optimizer, with_rng and not megatron)
    check_finite(items, root, iteration)
    _begin(root, iteration)
    items = _snapshot(items)
    common, metadata = _describe(model_chunks, optimizer, common, metadata, with_rng and not megatron)
    if megatron:
        items = _as_megatron(items, model_chunks, optimizer, common, metadata, iteration)
    return AsyncSave(root, iteration, items, common, metadata, ckpt_format, timeout)


def load_checkpoint(checkpoint_dir, model_chunks, optimizer=None, load_optimizer=True, load_rng=True,
                    fresh=None) -> tuple:
    """Load the folder into the model chunks (any layout), optionally the optimizer and this
    rank's RNG state; returns (metadata, common state). Every file is checked against its
    checksum first. `fresh(key)`: model keys the checkpoint does not hold, which keep their
    initial values (MTP layers added to a model saved without them)."""
    metadata = storage.read_metadata(checkpoint_dir)
    verify_checkpoint(checkpoint_dir, metadata)
    common = read_common_state(checkpoint_dir)
    layouts = param_layouts(model_chunks)
    items = [item for item in model_sharded_items(model_chunks) if fresh is None or not fresh(item.key)]
    refresh_masters = False
    if optimizer is not None and load_optimizer:
        if not metadata.get("has_optimizer", False):
            raise ValueError(f"--load {checkpoint_dir}: the checkpoint has no optimizer state; add "
                             "--no-load-optim (or --finetune) to load the model only")
        if "optimizer" not in common:
            raise storage.DamagedCheckpointError(
                f"{os.path.join(checkpoint_dir, storage.COMMON_FILENAME)}: missing, or without the optimizer's "
                "parameter groups; the checkpoint is damaged (add --no-load-optim to load the model only)")
        optimizer_items, refresh_masters, missing = prepare_for_load(optimizer, layouts,
                                                                     serialization.saved_keys(checkpoint_dir))
        report_fresh_states(f"--load {checkpoint_dir}", missing)
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
    masters_loaded = optimizer is not None and load_optimizer and not refresh_masters
    if not masters_loaded:  # FSDP shards take the model's values (else the masters are their values)
        for item in items:
            if getattr(item, "on_load", None) is not None:
                item.on_load()
    if optimizer is not None and load_optimizer:
        load_optimizer_common_state(optimizer, common["optimizer"], f"--load {checkpoint_dir}")
        if refresh_masters:
            optimizer.reload_model_params()
    if rng is not None:
        set_rng_state(rng.value)
    return metadata, common
