"""The hang watchdog (`--watchdog-timeout SECONDS`): a training step that runs longer than the
limit ends the job, saying which rank is stuck and where, instead of waiting for the collective
timeout (`--distributed-timeout-minutes`).

    watchdog = Watchdog(timeout_s, rank, world_size, peer_store())
    watchdog.step_started(iteration); ...; watchdog.step_ended()
    watchdog.close()

A thread of each rank wakes every `interval` (a quarter of the limit, at most a second), counts
a heartbeat into torchrun's key-value store (not a collective: it works while the ranks are
blocked in one) and checks its own step. When the step has run past the limit it reads the
other ranks' heartbeats twice, `3 * interval` apart: a rank whose count did not move is not
running at all (stopped, dead, or its host gone). It prints one line naming those ranks (or
saying that every rank is alive, so they are stuck in the step itself), dumps this rank's Python
stacks (`faulthandler`) and exits the process with EXIT_CODE; torchrun then stops the others.
Every running rank's watchdog does so, so each live rank's stack is printed.
"""

import faulthandler
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

EXIT_CODE = 124  # the `timeout` command's status: the step timed out
_KEY = "teratron/watchdog/rank/"


def peer_store():
    """A client of torchrun's key-value store (the rendezvous store at MASTER_ADDR:MASTER_PORT),
    or None without torch.distributed."""
    if not dist.is_initialized() or "MASTER_ADDR" not in os.environ:
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=10))


class Watchdog:
    def __init__(self, timeout_s: float, rank: int = 0, world_size: int = 1, store=None):
        self.timeout_s = timeout_s
        self.interval = min(1.0, timeout_s / 4)
        self.rank, self.world_size, self.store = rank, world_size, store
        self._step = None  # (iteration, monotonic start) while a step runs
        self._iteration = 0
        self._beats = 0
        self._stop = threading.Event()
        self._beat()  # every rank's key exists before any step can time out
        self._thread = threading.Thread(target=self._watch, daemon=True, name="teratron-watchdog")
        self._thread.start()

    def step_started(self, iteration: int) -> None:
        self._iteration = iteration
        self._step = (iteration, time.monotonic())

    def step_ended(self) -> None:
        self._step = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()
            step = self._step
            if step is not None and time.monotonic() - step[1] > self.timeout_s:
                self._fire(*step)

    def _beat(self) -> None:
        self._beats += 1
        if self.store is not None:
            try:
                self.store.set(f"{_KEY}{self.rank}", f"{self._beats} {self._iteration}")
            except Exception:  # noqa: BLE001 - a store that is gone must not stop the watching
                pass

    def _heartbeats(self) -> dict:
        """rank -> (count, iteration) of the ranks whose heartbeat could be read."""
        beats = {}
        for rank in range(self.world_size):
            try:
                count, iteration = self.store.get(f"{_KEY}{rank}").decode().split()
                beats[rank] = (int(count), int(iteration))
            except Exception:  # noqa: BLE001 - unreadable: counted as not running
                pass
        return beats

    def silent_ranks(self) -> dict:
        """rank -> last reported iteration (None: never read) of the ranks whose heartbeat stood
        still over `3 * interval`; this rank keeps beating meanwhile."""
        if self.store is None:
            return {}
        before = self._heartbeats()
        for _ in range(3):
            time.sleep(self.interval)
            self._beat()
        after = self._heartbeats()
        return {rank: (before[rank][1] if rank in before else None) for rank in range(self.world_size)
                if rank != self.rank and (rank not in after or before.get(rank) == after[rank])}

    def report(self, iteration: int, started: float) -> str:
        silent = self.silent_ranks()
        elapsed = time.monotonic() - started
        line = (f"teratron: watchdog: iteration {iteration} has run {elapsed:.1f} s on rank {self.rank}, over "
                f"--watchdog-timeout {self.timeout_s:g}; ")
        if silent:
            named = ", ".join(f"{rank} (last heartbeat in iteration {it})" if it is not None else f"{rank} (never seen)"
                              for rank, it in silent.items())
            line += f"stuck: rank(s) {named} stopped responding (stopped, dead, or its host is gone)"
        elif self.store is not None:
            line += "every rank is responding, so the ranks are stuck inside the step (a collective or a loop)"
        else:
            line += "this process is stuck inside the step"
        return line + f"; this rank's Python stack follows, then it exits with status {EXIT_CODE}"

    def _fire(self, iteration: int, started: float) -> None:
        print(self.report(iteration, started), file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_CODE)
