"""One run per save directory: no run replaces another's checkpoints by mistake.

    claim_save_dir(save, load, finetune, overwrite)   at the start of a run (a collective): rank 0
                                                      checks SAVE and takes its lock; every rank
                                                      raises the same one-line error if it may not
                                                      write there
    release_save_dir()                                at the end (every rank; rank 0 unlocks)

A run may write into SAVE when SAVE holds no checkpoints (iter_* folders), when the run resumes
them (`--load SAVE`, not `--finetune`, which starts a new run at iteration 0), or when
`--overwrite` allows it (its saves then replace SAVE's iterations and the tracker). Checkpoints
beside a missing or unreadable tracker are an error, not a fresh start.

SAVE/.teratron.lock records the host and PID of the run writing there; a second run is refused
while that process lives. A lock whose process is gone (same host, PID not running) is taken
over with a note; one from another host stays until its owner ends or a user deletes it, since
this host cannot see the other's processes.
"""

import json
import os
import socket
import time

import torch.distributed as dist

from teratron.dist_checkpointing import storage

LOCK_FILENAME = ".teratron.lock"

_held = None  # this process's claim: (save dir, lock record, folders it created)


class SaveDirError(ValueError):
    """--save may not be written by this run (the message says why and what to do)."""


def claim_save_dir(save: str, load: str | None = None, finetune: bool = False, overwrite: bool = False) -> None:
    """A collective: rank 0 locks `save` and checks its contents; raises SaveDirError on every
    rank when this run may not write there."""
    message = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            _claim(save, load, finetune, overwrite)
        except (ValueError, OSError) as e:
            message = str(e)
    if dist.is_initialized():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise SaveDirError(message)


def release_save_dir() -> None:
    """Give back this process's claim, if any: remove its lock, and the folders the claim created
    when nothing was saved in them."""
    global _held
    if _held is None:
        return
    save, record, created = _held
    _held = None
    lock = os.path.join(save, LOCK_FILENAME)
    if record is not None and _read_lock(lock) == record:
        os.unlink(lock)
    for folder in created:  # deepest first; stop at the first that holds something
        try:
            os.rmdir(folder)
        except OSError:
            break


def _claim(save, load, finetune, overwrite) -> None:
    global _held
    created = _missing_folders(os.path.abspath(save))
    os.makedirs(save, exist_ok=True)
    _held = (save, None, created)
    try:
        _held = (save, _lock(save), created)
        _check_contents(save, load, finetune, overwrite)
    except BaseException:
        release_save_dir()
        raise


def _missing_folders(path: str) -> list:
    """The folders makedirs(path) would create, deepest first."""
    missing = []
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _check_contents(save, load, finetune, overwrite) -> None:
    tracker = os.path.join(save, storage.TRACKER_FILENAME)
    if os.path.lexists(tracker) and not os.path.isfile(tracker):
        raise SaveDirError(f"{tracker}: not a file, so no checkpoint could be published there; remove it")
    found = storage.iteration_dirs(save)
    if not found:
        return
    what = f"checkpoints ({found[0]}" + (f" to {found[-1]})" if len(found) > 1 else ")")
    resumes = load is not None and os.path.realpath(load) == os.path.realpath(save)
    if resumes and not finetune:
        storage.read_tracker(save)  # checkpoints without a readable tracker: refused before training
        return
    if overwrite:
        print(f"NOTE: --overwrite: --save {save} holds {what}; this run's saves replace them", flush=True)
        return
    if resumes:
        raise SaveDirError(f"--save {save}: --finetune starts a new run at iteration 0, whose checkpoints would "
                           f"replace the {what} it loads; save the fine-tune into another folder, or pass "
                           "--overwrite")
    raise SaveDirError(f"--save {save}: holds {what} of a run this one does not resume; resume it with "
                       f"--load {save}, save into another folder, or pass --overwrite to replace them")


def _lock(save: str) -> dict:
    """Create SAVE's lock for this process (taking over a dead holder's); returns its record."""
    path = os.path.join(save, LOCK_FILENAME)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    if _create(path, record):
        return record
    holder = _read_lock(path)
    if holder is None:
        raise SaveDirError(f"--save {save}: locked by another run ({path} cannot be read); if no run writes there, "
                           "delete that file")
    who = f"host {holder.get('host')}, PID {holder.get('pid')}, since {holder.get('since')}"
    if not _holder_is_gone(holder):
        raise SaveDirError(f"--save {save}: another run ({who}) is writing checkpoints there; wait for it to end "
                           f"or choose another --save (if that run is gone, delete {path})")
    print(f"NOTE: --save {save}: the run that locked it ({who}) is no longer running; taking its lock over",
          flush=True)
    os.unlink(path)
    if not _create(path, record) or _read_lock(path) != record:
        raise SaveDirError(f"--save {save}: another run took its lock at the same moment; wait for it to end or "
                           "choose another --save")
    return record


def _create(path: str, record: dict) -> bool:
    """Write the lock if there is none (atomically: O_EXCL); False when one exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return True


def _read_lock(path: str):
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _holder_is_gone(holder: dict) -> bool:
    """True only when the holder ran on this host and its PID is not running."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # running, as another user
        return False
    return False
