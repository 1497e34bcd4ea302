"""Run a test function on N CPU ranks with gloo, so a parallel test reads like a serial one.

    results = run_distributed(check_tp_layer, world_size=4, hidden=16)

`fn(*args, **kwargs)` runs on every rank after `torch.distributed` is initialised (gloo, one
thread per rank); the list of its per-rank return values comes back (tensors included). A rank
that raises makes the whole call raise with that rank's traceback; a hang fails after `timeout`.
Ranks are forked, so `fn` may be any function, including one defined inside a test; they see no
GPU, also on a machine that has one (tests/conftest.py hides it from tests without the gpu mark).
"""

import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import socket
import traceback

import torch
import torch.distributed as dist


def free_ports(count: int) -> list[int]:
    """Distinct free ports below the OS's ephemeral range, held open together while chosen (so none
    is handed out twice). Below that range no process's connect() or bind(port 0) can take one
    between the choice and the listener's bind: a gloo rank starting up does both. Where the range
    starts too low to leave room, the OS picks (port 0)."""
    first_ephemeral = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first_ephemeral = int(f.read().split()[0])
    low_enough = first_ephemeral > 10_200
    # a generator of its own: tests that seed `random` would give every run the same ports
    candidates = random.Random().sample(range(10_000, first_ephemeral), 200) if low_enough else [0] * count
    sockets = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == count:
                return [s.getsockname()[1] for s in sockets]
        raise RuntimeError(f"no {count} free ports among {len(candidates)} tried below {first_ephemeral}")
    finally:
        for s in sockets:
            s.close()


def _rank_main(rank, world_size, port, fn, args, kwargs, conn):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(("ok", result), buf)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        buf = io.BytesIO()
        torch.save(("error", f"rank {rank}:\n{traceback.format_exc()}"), buf)
    conn.send_bytes(buf.getvalue())
    conn.close()
    try:
        from teratron import parallel_state
        parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - teardown only
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn, world_size, *args, timeout=300, **kwargs):
    ctx = mp.get_context("fork")
    port, = free_ports(1)
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, kwargs, child_conn))
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    results, errors = [None] * world_size, []
    pending = dict(zip(conns, range(world_size)))
    try:
        # Collect as ranks finish; the first failure ends the run (its peers would only hang).
        while pending and not errors:
            ready = mp.connection.wait(list(pending), timeout=timeout)
            if not ready:
                raise TimeoutError(f"ranks {sorted(pending.values())} gave no result within {timeout}s")
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, value = torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)
                except EOFError:
                    status, value = "error", f"rank {rank} died without a result"
                if status == "ok":
                    results[rank] = value
                else:
                    errors.append(value)
    finally:
        for p in procs:
            p.join(timeout=0 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed test failed on " + "\n".join(errors))
    return results
