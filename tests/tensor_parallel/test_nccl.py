"""The tensor-parallel checks again on 2 GPUs with NCCL: native collectives, CUDA tensors and
the CUDA generator. Run under torchrun by the test (or directly:
`torchrun --nproc-per-node 2 tests/tensor_parallel/test_nccl.py`)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_on_two_gpus_with_nccl():
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__],
                   check=True, timeout=300)


def _main():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    from test_cross_entropy import _check as check_cross_entropy
    from test_layers import _build_refs, check_layers
    from test_mappings import _check_comm, _check_mappings
    from test_random import SEED, _draw, _loss_and_grads

    from teratron import comm, parallel_state
    from teratron.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    torch.set_default_device("cuda")
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    n = dist.get_world_size()
    refs = _build_refs()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=n)
    _check_mappings(None, rank, n)
    _check_comm(rank)
    assert not comm._NO_NATIVE_ALL_GATHER and not comm._NO_NATIVE_REDUCE_SCATTER
    check_layers(refs, None, rank, n)
    check_cross_entropy(None, rank, n)

    model_parallel_cuda_manual_seed(SEED)
    with get_cuda_rng_tracker().fork():
        tp_mask = _draw()
    assert tp_mask.is_cuda and torch.equal(tp_mask, _draw(SEED + 2718 + rank))
    masks = [torch.empty_like(tp_mask) for _ in range(n)]
    dist.all_gather(masks, tp_mask)
    assert not torch.equal(masks[0], masks[1])
    plain, recomputed = _loss_and_grads(False), _loss_and_grads(True, distribute=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))
    dist.barrier()
    if rank == 0:
        print("nccl tensor-parallel checks passed")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
