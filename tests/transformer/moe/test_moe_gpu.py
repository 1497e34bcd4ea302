"""MoE on GPUs: the grouped-GEMM experts (torch._grouped_mm, bf16) against the per-expert loop,
and the layouts of test_moe_parallel.py over NCCL (nccl_moe_check.py under torchrun)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from teratron.transformer.moe import experts as experts_module
from teratron.transformer.moe.experts import GroupedMLP
from teratron.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="torch._grouped_mm needs a CUDA GPU of compute capability 9.0+")
def test_grouped_mm_equals_loop(monkeypatch):
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                               moe_ffn_hidden_size=128, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, params_dtype=torch.bfloat16, bf16=True, init_method_std=0.1)
    torch.manual_seed(0)
    experts = GroupedMLP(4, config)
    counts = [37, 0, 100, 19]  # an expert without tokens too
    tokens = torch.randn(sum(counts), 64, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(sum(counts), device="cuda")
    grad = torch.randn_like(tokens)

    def run():
        experts.zero_grad()
        x = tokens.clone().requires_grad_()
        y = experts(x, counts, probs)
        y.backward(grad)
        return y, x.grad, experts.weight1.grad.clone(), experts.weight2.grad.clone()

    assert experts_module._grouped_mm_usable(tokens, experts.weight1)
    grouped = run()
    monkeypatch.setattr(experts_module, "_grouped_mm_usable", lambda x, w: False)
    loop = run()
    for a, b in zip(grouped, loop):  # bf16 results; the two differ only in summation order
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_moe_layouts_over_nccl():
    script = os.path.join(os.path.dirname(__file__), "nccl_moe_check.py")
    gpus = 4 if torch.cuda.device_count() >= 4 else 2
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", script],
                   check=True, timeout=600)
