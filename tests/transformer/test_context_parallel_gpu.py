"""Context-parallel attention's CUDA kernels against fp32 attention over the whole sequence:
aten's flash kernel with log-sum-exp (whole and causal blocks, merged, and their backward from the
final output), FlexAttention for masked blocks (documents, a window) and for packed documents
without CP; on 2+ GPUs every comm type over NCCL (nccl_context_parallel_check.py under torchrun).
bf16 inputs: each result is compared with the fp32 reference at bf16's resolution."""

import os
import subprocess
import sys

import pytest
import torch

from teratron.transformer import context_parallel as cp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reference(q, k, v, allowed, scale):
    k, v = cp._expand_groups(k.float(), v.float(), q.shape[1])
    scores = (q.float() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


def _close(a, b):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel", ["flash", "flex"])
def test_blocks_on_cuda(kernel):
    torch.manual_seed(0)
    b, n, g, s, h, scale = 2, 8, 2, 512, 64, 0.125
    q, k, v = (torch.randn(b, heads, s, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (n, g, g))
    documents = (torch.arange(s, device="cuda") >= 300).long()[None]  # two documents
    allowed = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    if kernel == "flex":
        allowed = allowed & (documents[0, :, None] == documents[0, None, :])
    expected = _reference(q, k, v, allowed, scale)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    cuts = [(0, 128), (128, 384), (384, 512)]
    blocks = []
    for start, end in cuts:
        for qs, qe in cuts:
            if qs < start:
                continue
            if kernel == "flash":
                blocks.append(cp.Block(slice(qs, qe), slice(start, end), "causal" if qs == start else "full"))
            else:
                mask = cp.KeyMask(torch.arange(qs, qe, device="cuda"), torch.arange(start, end, device="cuda"),
                                  causal=True, documents=documents)
                blocks.append(cp.Block(slice(qs, qe), slice(start, end), "masked", mask))
    flex = kernel == "flex"
    with torch.no_grad():
        merged = cp._Merged(q, h)
        for block in blocks:
            merged.add(block.q, *cp.block_forward(block, q, k, v, scale, flex))
        out = merged.out.to(q.dtype)
        _close(out, expected)
        grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
        for block in blocks:
            gq, gk, gv = cp.block_backward(block, dout.to(q.dtype), q, k, v, out, merged.lse, scale, flex)
            grads[0][:, :, block.q] += gq
            grads[1][:, :, block.kv] += gk
            grads[2][:, :, block.kv] += gv
    for grad, t in zip(grads, (q, k, v)):
        _close(grad, t.grad)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_comm_types_over_nccl():
    script = os.path.join(os.path.dirname(__file__), "nccl_context_parallel_check.py")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", script], check=True,
                   timeout=600)
