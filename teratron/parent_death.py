"""No rank outlives its launcher: `exit_with_parent()` asks the Linux kernel to SIGKILL this
process when its parent (torchrun's agent, which starts every rank in a Unix session of its own,
so a signal to the launcher's process group never reaches the ranks) dies.

The kernel delivers the signal when the parent dies after the request; a parent that died
before it is noticed by comparing `os.getppid()` with the parent this process had when
teratron was first imported (or when it was forked): an orphan has been re-parented to init or a
subreaper. Why SIGKILL and not SIGTERM: docs/design.md "Fault tolerance".
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_parent_pid = os.getppid()  # the parent at start-up; the check below compares with it
_forking_pid = None


def _remember_forking_process() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _forked_child_parent() -> None:
    global _parent_pid
    _parent_pid = _forking_pid


os.register_at_fork(before=_remember_forking_process, after_in_child=_forked_child_parent)

_noted = False


def exit_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent dies; if the parent is already gone,
    die now. Returns False (after a one-time note) where the kernel has no such request (not Linux)."""
    global _noted
    if not sys.platform.startswith("linux"):
        if not _noted:
            print(f"NOTE: on {sys.platform} a rank is not stopped when its launcher dies (Linux only); "
                  "stop stray ranks yourself before restarting a job", flush=True)
            _noted = True
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != _parent_pid:  # the parent died before the request: it will never fire
        print(f"teratron: the launcher (pid {_parent_pid}) is gone; this rank (pid {os.getpid()}) stops",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return True
