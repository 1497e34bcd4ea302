"""The check of the Gated Delta Product mixer on the Triton kernels (the convolution, the gated delta rule
over the expanded sequence, the gated norm) in Triton's interpreter, which test_gated_delta_product.py runs
in a subprocess (Triton reads TRITON_INTERPRET when kernels are defined):

    TRITON_INTERPRET=1 python tests/ssm/gated_delta_product_cases.py

compares the mixer's output and gradients (input and parameters) with its PyTorch path on the same
parameters, in fp32 (to 1e-5 of each one's largest value), on plain rows and on packed documents (chunks of 16 expanded tokens, so chunks cut
tokens' substeps apart); prints "ok".
"""

import importlib
import os
from unittest import mock

import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ssm.packed_documents import seq_idx_of
from teratron.packed_seq_params import PackedSeqParams, cu_seqlens_from_documents
from teratron.ssm import gated_delta_rule_chunked, gated_norm_triton
from teratron.ssm.causal_conv1d import causal_conv1d
from teratron.ssm.gated_delta_product import GatedDeltaProductMixer

gdp_module = importlib.import_module("teratron.ssm.gated_delta_product")
from teratron.transformer.transformer_config import TransformerConfig

S, B, H = 24, 2, 16


def _mixer():
    torch.manual_seed(5)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
                               init_method_std=0.2, hybrid_layer_pattern="M", gdp_layers=True, mamba_state_dim=8,
                               mamba_head_dim=4, mamba_num_groups=2, mamba_num_heads=4, gdp_num_householder=3)
    m = GatedDeltaProductMixer(config)
    m.chunk_size = 16
    return m


def _pytorch_conv(x, weight, bias=None, initial_state=None, seq_idx=None):
    y, state = causal_conv1d(x, weight, bias, initial_state, seq_idx)
    return F.silu(y), state


def _outputs_and_grads(m, x, upstream, packed):
    x = x.clone().requires_grad_()
    out = m(x, attention_mask=packed)[0]
    grads = torch.autograd.grad(out, [x, *m.parameters()], upstream)
    return [out.detach(), *grads]


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    gen = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    cu = cu_seqlens_from_documents(seq_idx_of([1, 9, 14], [S]))
    for packed in (None, PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu)):
        m = _mixer()
        triton = _outputs_and_grads(m, x, upstream, packed)
        with mock.patch.object(gdp_module, "gated_delta_rule", gated_delta_rule_chunked), \
                mock.patch.object(gdp_module, "causal_conv1d_silu", _pytorch_conv), \
                mock.patch.object(gated_norm_triton, "runs_here", lambda *args: False):
            pytorch = _outputs_and_grads(m, x, upstream, packed)
        names = ["out", "dx"] + [name for name, _ in m.named_parameters()]
        for name, got, want in zip(names, triton, pytorch):
            # fp32's rounding, which grows with a value's size (sums over the tokens) and at document starts
            assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item(), msg=name)
    print("ok")


if __name__ == "__main__":
    main()
