"""How much GEMM time each kind of data-parallel traffic costs (the probe behind
`--ddp-copy-engine-collectives`; docs/performance.md, bench/RESULTS.md 2026-11-30 19:42-19:48).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        torchrun --nproc-per-node 2 bench/collective_contention.py

Two GPUs of one node. Each phase runs 6,000 [8192, 2048] x [2048, 5632] bf16 GEMMs on the main
stream with one side-stream operation enqueued every few GEMMs (sized from the operation's time
alone, so the side stream stays busy the whole phase): none, an NCCL reduce-scatter (fp32, 51 M
elements), a copy-engine reduce-scatter (pull the peer's partial sums of our half from symmetric
memory, add), the pull alone, NCCL and copy-engine all-gathers (bf16), and a local copy and add
of 205 MB. Prints the time per GEMM of each phase; run `nvidia-smi --query-gpu=timestamp,index,
clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 100` beside it for clocks.
"""
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

N = 51_380_224


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", rank)
    shard, peer = N // 2, 1 - rank
    a = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
    b = torch.randn(2048, 5632, device=dev, dtype=torch.bfloat16)
    g = torch.randn(N, device=dev)
    local_src, local_dst = torch.randn(N, device=dev), torch.empty(N, device=dev)
    sym = symm_mem.empty(N, dtype=torch.float32, device=dev)
    sym.normal_()
    h = symm_mem.rendezvous(sym, dist.group.WORLD.group_name)
    tmp = torch.empty(shard, device=dev)
    side = torch.cuda.Stream(device=dev)

    def nccl_rs():
        dist.reduce_scatter_tensor(g[rank * shard:(rank + 1) * shard], g)

    def ce_pull():
        tmp.copy_(h.get_buffer(peer, (shard,), torch.float32, rank * shard))

    def hbm_copy():
        local_dst.copy_(local_src)

    def hbm_kernel():
        torch.add(local_src, 1.0, out=local_dst)

    def ce_rs():
        ce_pull()
        g[rank * shard:(rank + 1) * shard].add_(tmp)

    def nccl_ag():
        dist.all_gather_into_tensor(g.view(torch.bfloat16)[:N], g.view(torch.bfloat16)[rank * shard:(rank + 1) * shard])

    def ce_ag():
        tmp.view(torch.bfloat16)[:shard].copy_(h.get_buffer(peer, (shard,), torch.bfloat16, peer * shard))

    # side-op duration alone, to interleave the enqueue so both streams stay busy (the launch queue
    # blocks the host once ~1000 launches are pending, so enqueueing all side work first would not overlap)
    loads = {"none": None, "nccl_rs": nccl_rs, "ce_rs": ce_rs, "ce_pull": ce_pull, "nccl_ag": nccl_ag,
             "ce_ag": ce_ag, "hbm_memcpy": hbm_copy, "hbm_add_kernel": hbm_kernel}
    gemm_us = None
    for rep in range(2):
        for name, load in loads.items():
            side_us = 0.0
            if load is not None:
                for _ in range(3):
                    load()
                torch.cuda.synchronize()
                dist.barrier()
                t = time.perf_counter()
                for _ in range(40):
                    load()
                torch.cuda.synchronize()
                side_us = (time.perf_counter() - t) / 40 * 1e6
            torch.cuda.synchronize()
            dist.barrier()
            gemms = 6000
            per_side = max(1, int(gemm_us / side_us / 1.15)) if load is not None else 0
            agreed = torch.tensor([per_side], device=dev)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # collectives: both ranks issue the same count
            per_side = int(agreed.item())
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.time()
            ev0.record()
            for i in range(gemms):
                if load is not None and i % per_side == 0:
                    with torch.cuda.stream(side):
                        load()
                torch.mm(a, b)
            ev1.record()
            ev1.synchronize()
            t1 = time.time()
            ms = ev0.elapsed_time(ev1)
            torch.cuda.synchronize()
            side_done = time.time()
            if load is None:
                gemm_us = ms / gemms * 1e3
            print(f"rank {rank} phase {name:<15} {time.strftime('%H:%M:%S', time.gmtime(t0))}+{t0 % 1:.2f} "
                  f"{t1 - t0:5.2f} s gemm {ms / gemms * 1e3:7.1f} us each; side op alone {side_us:6.0f} us, "
                  f"one per {per_side} GEMMs, ran until +{side_done - t1:5.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
