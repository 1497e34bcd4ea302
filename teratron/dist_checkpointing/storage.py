"""The checkpoint folder protocol.

    ROOT/latest_checkpointed_iteration.txt   the newest complete iteration (written last)
    ROOT/iter_0000100/                        one checkpoint:
        .metadata, __*_*.distcp               torch.distributed.checkpoint data (every tensor)
        metadata.json                         format + version, model args, saved layout, notes,
                                              every other file's size and sha256 ("files")
        common.pt                             rank 0's small state (args, scheduler, counters)
    ROOT/hf/                                  Hugging Face config and tokenizer files, if imported

A checkpoint is written into ROOT/.tmp_iter_0000100/ and renamed when every rank has finished;
only then is the tracker replaced (atomically). A crash mid-save leaves a hidden temporary folder
and the previous checkpoint as the latest one. Merges and Hugging Face exports are assembled in
a hidden `.NAME.<pid>.partial` folder beside their output (`staging_dir`) and renamed into place.

Loading checks every recorded file's size and sha256 first (`verify_files`), so a damaged,
truncated or missing file is named in one line before anything is read from it. (sha256 rather
than a CRC: it runs at about 1.4 GB/s a core against crc32's 3 GB/s, and it makes metadata.json
vouch for every other file, so a user who trusts metadata.json can trust the whole folder.)
"""

import hashlib
import json
import os
import re
import shutil

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
METADATA_FILENAME = "metadata.json"
COMMON_FILENAME = "common.pt"
HF_DIRNAME = "hf"
FORMAT = "teratron_torch_dist"
FORMAT_VERSION = 1
_ITERATION_DIR = re.compile(r"iter_\d{7}")
_BLOCK = 1 << 24  # bytes read at a time while checksumming


class DamagedCheckpointError(OSError):
    """A checkpoint file is missing, truncated, altered or unparsable (the message names it)."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def temporary_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f".tmp_iter_{iteration:07d}")


def staging_dir(final: str) -> str:
    """A new empty hidden folder beside `final`, to be renamed to it once complete. It is named
    after this process and never pre-deleted, so no user folder is taken for a leftover."""
    parent, name = os.path.split(os.path.abspath(final))
    staging = os.path.join(parent, f".{name}.{os.getpid()}.partial")
    os.makedirs(staging)
    return staging


def iteration_dirs(root: str) -> list:
    """The names of ROOT's published checkpoints (iter_NNNNNNN folders), oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if _ITERATION_DIR.fullmatch(n) and os.path.isdir(os.path.join(root, n)))


def read_tracker(root: str):
    """The iteration named by ROOT's tracker, or None when ROOT holds no checkpoint yet. Checkpoints
    without a readable tracker are an error: which one is the latest is unknown."""
    tracker = os.path.join(root, TRACKER_FILENAME)
    if not os.path.lexists(tracker):
        found = iteration_dirs(root)
        if found:
            raise ValueError(f"{root} holds {', '.join(found[-3:])} but no {TRACKER_FILENAME}, so which checkpoint "
                             f"is the latest is unknown; write the iteration to resume from into {tracker}")
        return None
    try:
        with open(tracker, "rb") as f:
            text = f.read(64).decode("utf-8", errors="replace").strip()
    except OSError as e:
        raise ValueError(f"{tracker} cannot be read ({e.strerror}); write the iteration of the latest "
                         "checkpoint into it") from None
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{tracker} holds {text!r}, not an iteration number; fix or delete the file")
    return int(text)


def replace_file(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: str, final: str) -> None:
    """Rename `tmp` to `final`. An older `final` (the same iteration saved again, possibly the one
    the tracker names) is set aside and deleted only once its replacement is in place, and put
    back if the rename fails: the tracker never names a folder that is half deleted."""
    if not os.path.isdir(final):
        os.rename(tmp, final)
        return
    aside = os.path.join(os.path.dirname(final), ".replaced_" + os.path.basename(final))
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    shutil.rmtree(aside)


def publish(root: str, iteration: int) -> str:
    """Rename the finished temporary folder to its iteration folder, then point the tracker at it."""
    final = iteration_dir(root, iteration)
    _move_into_place(temporary_dir(root, iteration), final)
    _fsync_dir(root)
    replace_file(os.path.join(root, TRACKER_FILENAME), str(iteration))
    _fsync_dir(root)
    return final


def file_record(path: str) -> dict:
    """{"bytes": size, "sha256": hex digest} of a file."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


def record_files(checkpoint_dir: str) -> dict:
    """name -> file_record of every file in the folder but metadata.json (one process's checksums)."""
    return {name: file_record(os.path.join(checkpoint_dir, name)) for name in sorted(os.listdir(checkpoint_dir))
            if name != METADATA_FILENAME and os.path.isfile(os.path.join(checkpoint_dir, name))}


def verify_file(checkpoint_dir: str, name: str, record: dict) -> None:
    """Raise DamagedCheckpointError unless the file has the recorded size and sha256."""
    path = os.path.join(checkpoint_dir, name)
    advice = "restore it, or load another checkpoint"
    if not os.path.isfile(path):
        raise DamagedCheckpointError(f"{path}: missing (metadata.json lists it); the checkpoint is incomplete: "
                                     f"{advice}")
    found = file_record(path)
    if found["bytes"] != record.get("bytes"):
        raise DamagedCheckpointError(f"{path}: {found['bytes']} bytes where {record.get('bytes')} were saved "
                                     f"(truncated or overwritten); the checkpoint is damaged: {advice}")
    if found["sha256"] != record.get("sha256"):
        raise DamagedCheckpointError(f"{path}: its bytes changed since it was saved (sha256 differs from "
                                     f"metadata.json); the checkpoint is damaged: {advice}")


def verify_files(checkpoint_dir: str, metadata: dict, names=None) -> None:
    """Check the files metadata.json records (all, or `names`); checkpoints saved before teratron
    recorded checksums have none to check."""
    records = metadata.get("files") or {}
    for name in sorted(records) if names is None else names:
        verify_file(checkpoint_dir, name, records[name])


def write_metadata(checkpoint_dir: str, metadata: dict) -> None:
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, **metadata}
    replace_file(os.path.join(checkpoint_dir, METADATA_FILENAME), json.dumps(body, indent=1, sort_keys=True))


def read_metadata(checkpoint_dir: str) -> dict:
    path = os.path.join(checkpoint_dir, METADATA_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{checkpoint_dir}: no {METADATA_FILENAME}; not a teratron sharded checkpoint "
                                "(or one whose save did not finish)")
    try:
        with open(path) as f:
            metadata = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not a teratron checkpoint (format is not {FORMAT!r})")
    if metadata.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path}: format version {metadata['format_version']} is newer than this teratron "
                         f"reads ({FORMAT_VERSION}); upgrade teratron")
    return metadata


def resolve_checkpoint_dir(path: str, flag: str = "--load") -> str:
    """An iteration folder: `path` itself, or the one its tracker names (`flag` names the
    command-line option the path came from, for the error message)."""
    if os.path.isfile(os.path.join(path, METADATA_FILENAME)):
        return path
    iteration = read_tracker(path)
    if iteration is None:
        raise FileNotFoundError(f"{flag} {path}: neither a checkpoint folder (no {METADATA_FILENAME}) nor a "
                                f"save directory (no {TRACKER_FILENAME}); pass the --save folder of a run")
    return iteration_dir(path, iteration)


def checkpoint_root(checkpoint_dir: str) -> str:
    """The save directory an iteration folder lives in."""
    return os.path.dirname(os.path.abspath(checkpoint_dir))
