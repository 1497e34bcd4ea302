"""--config-logger-dir (Megatron's flag): each run writes its whole RunConfig (`RunConfig.to_dict`,
what every checkpoint records as `args`) as one JSON file into the folder, named by the UTC start
time and the iteration it starts from, so a resumed run adds a file next to the first run's.
Megatron dumps each module's constructor arguments there; teratron's modules are built from the
run description alone, so the run description is the whole of it."""

import json
import os
import tempfile
import time


def config_file_name(start_iteration: int, now: float) -> str:
    return f"run_config_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}_iter{start_iteration:07d}.json"


def write_run_config(run, directory: str, start_iteration: int, now=None) -> str:
    """Write `run` into `directory` atomically (a temporary file renamed over the name: a reader
    sees no file or the whole one); returns the file's path."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(f"--config-logger-dir {directory}: cannot create it ({e.strerror}); pass a writable "
                      "folder") from e
    path = os.path.join(directory, config_file_name(start_iteration, time.time() if now is None else now))
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".run_config.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(run.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path
