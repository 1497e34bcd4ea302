"""The resharding checks of test_resharding.py on CUDA tensors over NCCL, one process per GPU
(run by test_gpu.py under torchrun), plus an async save from GPU memory."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
from test_resharding import (LAYOUTS, assemble, assert_same, build, load_run, report,  # noqa: E402
                             save_run, train)

from teratron import parallel_state as ps  # noqa: E402
from teratron.dist_checkpointing import load_full, start_async_save, storage  # noqa: E402


def gathered(reports):
    """Every rank's reports (on the CPU), on every rank."""
    cpu = [[tuple(x.cpu() if isinstance(x, torch.Tensor) else x for x in row) for row in r] for r in reports]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, cpu)
    return out


def main(root):
    sources = ["tp2", "pp2vpp2", "dp2_distopt"]
    pairs = [("tp2", "tp1pp2"), ("pp2vpp2", "tp2"), ("dp2_distopt", "tp1pp2")]
    saved, loaded = gathered(save_run(root, sources)), gathered(load_run(root, pairs))
    for i, (source, target) in enumerate(pairs):
        expected = {k: v for k, v in assemble([r[i] for r in saved]).items() if k[1] != "fp32_param"}
        got = {k: v for k, v in assemble([r[i] for r in loaded]).items() if k[1] != "fp32_param"}
        assert_same(expected, got, f"cuda {source} -> {target}")
    chunks, optimizer = build(LAYOUTS["dp2_distopt"], seed=1)
    train(chunks, optimizer)
    before = assemble(r[0] for r in gathered([report(chunks, optimizer)]))
    pending = start_async_save(f"{root}/async", 2, chunks, optimizer)
    with torch.no_grad():  # training goes on while the GPU snapshot is written
        for p in chunks[0].parameters():
            p.add_(1.0)
    pending.finalize(blocking=True)
    ps.destroy_model_parallel()
    saved_async = load_full(storage.resolve_checkpoint_dir(f"{root}/async"), lambda k: True)
    for (name, what), value in before.items():
        if what in ("param", "exp_avg", "exp_avg_sq"):
            key = name if what == "param" else f"optimizer.state.{what}.{name}"
            assert torch.equal(saved_async[key], value), key


if __name__ == "__main__":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    root = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    main(holder[0])
    dist.destroy_process_group()
