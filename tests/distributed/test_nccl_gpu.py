"""DDP + distributed optimizer on 2 GPUs with NCCL (async reduce-scatter and all-gather on CUDA
streams, pinned CPU offload) and with copy-engine collectives (symmetric memory, overlaps on and
off) equal one GPU with gradient accumulation over the same batch (the CPU-stepped half of an
offloaded run up to one rounding: see _worker).

The pytest entry launches this file with torchrun; `python -m torch.distributed.run
--nproc-per-node 2 tests/distributed/test_nccl_gpu.py` runs the workers directly.
"""

import os
import subprocess
import sys

import pytest
import torch

STEPS, BATCH, HIDDEN, LR = 4, 8, 256, 1e-3


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(4 * HIDDEN, HIDDEN)).to(device=device, dtype=torch.bfloat16)


def _data(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, BATCH, HIDDEN, generator=g)
    return x.to(device), torch.randn(STEPS, BATCH, HIDDEN, generator=g).to(device)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)


def _reference(device, fused):
    """One GPU: two half-batch microbatches, bf16 grads summed in fp32, AdamW on fp32 masters;
    the fused CUDA kernel when teratron uses it (every master on the GPU), else the plain loop
    (which a CPU-offloaded step matches up to one rounding)."""
    model = _model(device)
    masters = [p.detach().float() for p in model.parameters()]
    impl = dict(fused=True) if fused else dict(foreach=False)
    adamw = torch.optim.AdamW([{"params": [m for m in masters if m.dim() == 2], "weight_decay": 0.01},
                               {"params": [m for m in masters if m.dim() == 1], "weight_decay": 0.0}],
                              lr=LR, **impl)
    x, y = _data(device)
    for step in range(STEPS):
        grads = [torch.zeros_like(m) for m in masters]
        for xb, yb in zip(x[step].chunk(2), y[step].chunk(2)):
            model.zero_grad()
            _loss(model, xb, yb).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad.float()
        for m, g in zip(masters, grads):
            m.grad = g / 2
        adamw.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    return [p.detach() for p in model.parameters()]


def _worker():
    import torch.distributed as dist

    from teratron import parallel_state
    from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from teratron.optimizer import OptimizerConfig, get_megatron_optimizer

    class Config:
        calculate_per_token_loss = False

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel()
    runs = [(0.0, False, True), (0.5, False, True), (0.0, True, True), (0.0, True, False)]
    for offload, copy_engine, overlap in runs:
        ref = _reference(device, fused=offload == 0.0)
        ddp = DistributedDataParallel(Config(), DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
            overlap_param_gather=overlap, copy_engine_collectives=copy_engine,
            bucket_size=HIDDEN * HIDDEN), _model(device))
        opt = get_megatron_optimizer(OptimizerConfig(
            lr=LR, weight_decay=0.01, bf16=True, params_dtype=torch.bfloat16, clip_grad=0.0,
            optimizer_cpu_offload=offload > 0, optimizer_offload_fraction=offload), [ddp])
        # NCCL scales each rank's grads by 1/DP inside the reduce-scatter (premultiplied sum), the
        # copy engine's add multiplies the sum; the bit-for-bit comparison below holds both to the
        # reference's sum then halving.
        assert all(buffer.nccl for buffer in ddp.buffers)
        assert all((buffer.copy_engine is not None) == copy_engine for buffer in ddp.buffers)
        assert len(ddp.buffers[0].buckets) > 1 or not overlap  # without overlap: one bucket
        x, y = _data(device)
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            half = BATCH // 2
            _loss(ddp, x[step][rank * half:(rank + 1) * half], y[step][rank * half:(rank + 1) * half]).backward()
            finalize_model_grads([ddp])
            assert opt.step()[0]
        ddp.start_param_sync(force_sync=True)
        # On the GPU the same kernels as the reference: bit for bit. Offloaded masters step on
        # the CPU, whose fp32 Adam can round one operation differently from the GPU's (fused
        # multiply-add, division): a master then differs by one fp32 unit, which moves its bf16
        # param by at most one bf16 unit (2^-7 relative) when it crosses a rounding boundary
        # (seen: 4 of 525,568 elements on two H200s).
        tol = dict(rtol=0, atol=0) if offload == 0.0 else dict(rtol=2 ** -7, atol=0)
        for p, r in zip(ddp.module.parameters(), ref):
            torch.testing.assert_close(p, r, **tol)
    if rank == 0:
        print("NCCL_DDP_OK", flush=True)
    dist.destroy_process_group()


@pytest.mark.gpu
def test_ddp_distributed_optimizer_on_two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": root})
    assert result.returncode == 0 and "NCCL_DDP_OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


if __name__ == "__main__":
    _worker()
