"""tp_comm_overlap: column/row-parallel layers whose sequence-parallel all-gather / reduce-scatter
run fused with their GEMMs give the plain layers' outputs and gradients (input, weight, bias).

On CPU (gloo, 2 ranks) the fused functions run collective-then-GEMM, which tests the autograd
around them; `test_comm_overlap_on_two_gpus` runs the same check on 2 GPUs, where PyTorch's
symmetric-memory ops pipeline the chunks (bf16, bound: one bf16 rounding, see _check).
The whole model (TP=2 + SP + overlap, with the distributed optimizer) against the single process
is in tests/distributed/test_gpt_distributed_optimizer.py.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.testing import assert_close

from dist import run_distributed
from teratron import parallel_state
from teratron.model_parallel_config import ModelParallelConfig
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear, comm_overlap

S, B, H, F_ = 16, 2, 32, 64


def _config(overlap, dtype):
    return ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=overlap,
                               params_dtype=dtype)


def _layers(overlap, dtype):
    torch.manual_seed(0)
    init = torch.nn.init.normal_
    column = ColumnParallelLinear(H, F_, config=_config(overlap, dtype), init_method=init, bias=True)
    row = RowParallelLinear(F_, H, config=_config(overlap, dtype), init_method=init, bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    assert column.tp_comm_overlap == row.tp_comm_overlap == overlap
    return column, row


def _run(layer, x, grad):
    x = x.clone().requires_grad_()
    out = layer(x)[0]
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _inputs(rank, dtype, device):
    """Per-rank [s/2, b, h] column input / row output grad, full [s, b, f/2] row input / column grad."""
    g = torch.Generator().manual_seed(10 + rank)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return draw(S // 2, B, H), draw(S, B, F_ // 2), draw(S, B, F_ // 2), draw(S // 2, B, H)


def _check(dtype=torch.float32, device="cpu"):
    """Returns how often the fused all-gather+GEMM ran (counted through the module attribute)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    calls = []
    fused = comm_overlap.all_gather_matmul
    comm_overlap.all_gather_matmul = lambda *a: calls.append(1) or fused(*a)
    try:
        col_x, col_grad, row_x, row_grad = _inputs(parallel_state.get_tensor_model_parallel_rank(), dtype, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain, overlapped = _layers(False, dtype), _layers(True, dtype)
        # Each result is one GEMM with fp32 accumulation rounded once to `dtype`; chunking the GEMM
        # can move that rounding by one unit: 2^-7 relative in bf16 (8-bit significand), 0 in fp32
        # on CPU (the fallback runs the same unchunked GEMM).
        tol = dict(rtol=2 ** -7, atol=0) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
        for a, b in ((plain[0], overlapped[0]), (plain[1], overlapped[1])):
            x, grad = (col_x, col_grad) if isinstance(a, ColumnParallelLinear) else (row_x, row_grad)
            for expected, got in zip(_run(a, x, grad), _run(b, x, grad)):
                assert_close(got, expected, **tol)
    finally:
        comm_overlap.all_gather_matmul = fused
        parallel_state.destroy_model_parallel()
    return len(calls)


def test_overlapped_layers_equal_the_plain_layers_on_cpu():
    # once in the column layer's forward, once in the row layer's backward
    assert run_distributed(_check, 2) == [2, 2]


def test_tp_comm_overlap_needs_sequence_parallel():
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        ModelParallelConfig(tensor_model_parallel_size=2, tp_comm_overlap=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_comm_overlap_on_two_gpus():
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # for tests/dist.py
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__],
                   check=True, timeout=300, env=env)


def _main():
    import torch.distributed as dist

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    assert _check(torch.bfloat16, "cuda") == 2
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
