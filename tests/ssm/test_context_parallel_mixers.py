"""Context parallelism inside the recurrent mixers (teratron/ssm/context_parallel.py): Mamba-2's, Gated
DeltaNet's and Gated Delta Product's on four gloo ranks under CP 2, CP 4 and TP 2 x CP 2 (so groups, B and C or key
heads, both split over CP and repeated on several CP ranks), on plain rows and on packed documents
('sbhd' rows and one 'thd' row): each rank's output and input gradient equal those rows of one
process's, and the parameters' gradients summed over the CP ranks equal its (TP shards of them); on
the PyTorch paths and on the Triton kernels (in Triton's interpreter)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist import run_distributed
from kernel_tests import gpu_test, run_in_the_interpreter
from teratron.packed_seq_params import PackedSeqParams, cu_seqlens_from_documents
from teratron.process_groups import ProcessGroupCollection
from teratron.ssm import GatedDeltaNet
from teratron.ssm.context_parallel import channel_index, head_shares
from teratron.ssm.gated_delta_product import GatedDeltaProductMixer
from teratron.ssm.mamba_mixer import MambaMixer
from teratron.tensor_parallel.utils import shard_tensor
from teratron.transformer.context_parallel import cp_token_index
from teratron.transformer.transformer_config import TransformerConfig

S, B, H = 16, 2, 16


def _config(tp, **fields):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, tensor_model_parallel_size=tp,
                             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                             init_method_std=0.2, **fields)


def _mamba(chunk, tp=1, groups=None):
    """8 heads of 4 channels in 2 groups."""
    torch.manual_seed(5)
    return MambaMixer(_config(tp), pg_collection=groups, d_state=4, head_dim=4, ngroups=2, chunk_size=chunk)


def _gated_delta_net(chunk, tp=1, groups=None):
    """2 key heads of 4 channels, each serving 2 value heads of 3."""
    torch.manual_seed(5)
    m = GatedDeltaNet(_config(tp, normalization="RMSNorm", linear_conv_kernel_dim=3, linear_key_head_dim=4,
                              linear_value_head_dim=3, linear_num_key_heads=2, linear_num_value_heads=4),
                      pg_collection=groups)
    m.chunk_size = chunk
    return m


def _gated_delta_product(chunk, tp=1, groups=None):
    """8 heads of 4 channels in 2 groups, 2 substeps a token."""
    torch.manual_seed(5)
    m = GatedDeltaProductMixer(_config(tp, hybrid_layer_pattern="M", gdp_layers=True, mamba_state_dim=4,
                                       mamba_head_dim=4, mamba_num_groups=2, mamba_num_heads=8, gdp_num_householder=2),
                               pg_collection=groups)
    m.chunk_size = chunk
    return m


# Parameters sharded over TP: (dim, stride) as each mixer builds them.
MAMBA_SHARDS = {"in_proj.weight": (0, (32, 32, 8, 8, 8)), "conv1d.weight": (0, (32, 8, 8)),
                "conv1d.bias": (0, (32, 8, 8)), "dt_bias": (0, 1), "A_log": (0, 1), "D": (0, 1),
                "norm.weight": (0, 1), "out_proj.weight": (1, 1)}
GDN_SHARDS = {"in_proj.weight": (0, (8, 8, 12, 12, 4, 4)), "conv1d.weight": (0, (8, 8, 12)), "dt_bias": (0, 1),
              "A_log": (0, 1), "out_proj.weight": (1, 1), "out_norm.weight": None}
GDP_SHARDS = {"in_proj.weight": (0, (32, 32, 32, 8, 8, 8, 8, 8, 8)), "conv1d.weight": (0, (32, 32, 8, 8, 8)),
              "dt_bias": (0, 1), "A_log": (0, 1), "norm.weight": (0, 1), "out_proj.weight": (1, 1)}
MIXERS = {"mamba": (_mamba, MAMBA_SHARDS), "gated delta net": (_gated_delta_net, GDN_SHARDS),
          "gated delta product": (_gated_delta_product, GDP_SHARDS)}


def _packed(layout, seq):
    """Rows of `seq` tokens (a multiple of 16) of packed documents."""
    if layout is None:
        return None
    if layout == "sbhd":  # documents of 1, 5, 6, seq - 12 and seq tokens (starts on and off the chunks)
        return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens_from_documents(
            torch.tensor([[0] + [1] * 5 + [2] * 6 + [3] * (seq - 12), [4] * seq])))
    # one row of 2 seq: documents of seq / 2, seq and seq / 2 tokens (multiples of 2 x CP for CP 2 and 4)
    bounds = [0, seq // 2, 3 * seq // 2, 2 * seq]
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(bounds, dtype=torch.int32))


def _run(m, x, upstream, packed):
    x = x.clone().requires_grad_()
    out = m(x, attention_mask=packed)[0]
    out.backward(upstream)
    return out.detach(), x.grad, {name: p.grad for name, p in m.named_parameters()}


def _groups():
    """(name, CP size, TP size, this rank's ProcessGroupCollection) of each layout of four ranks."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    world = dist.new_group([0, 1, 2, 3])
    return [("cp2", 2, 1, ProcessGroupCollection(cp=pairs[rank // 2])),
            ("cp4", 4, 1, ProcessGroupCollection(cp=world)),
            ("tp2 x cp2", 2, 2, ProcessGroupCollection(tp=pairs[rank // 2], cp=strided[rank % 2]))]


def check_every_layout(seq=S, chunk=4, mixers=tuple(MIXERS)):
    """The failures of every mixer (of `mixers`), packing and layout, and how many were checked (on
    each rank): rows of `seq` tokens, the scans' chunks of `chunk`."""
    rank, failures, checked = dist.get_rank(), [], 0
    layouts = _groups()
    for kind in mixers:
        build, shards = MIXERS[kind]
        for packing in (None, "sbhd", "thd"):
            batch, length = (1, 2 * seq) if packing == "thd" else (B, seq)
            gen = torch.Generator().manual_seed(0)
            x, upstream = torch.randn(length, batch, H, generator=gen), torch.randn(length, batch, H, generator=gen)
            packed = _packed(packing, seq)
            expected, expected_dx, expected_grads = _run(build(chunk), x, upstream, packed)
            for name, cp, tp, groups in layouts:
                cp_rank, tp_rank = dist.get_rank(groups.cp), dist.get_rank(groups.tp) if tp > 1 else 0
                bounds = packed.boundaries.tolist() if packing == "thd" else None
                index = cp_token_index(length, cp, cp_rank, bounds)
                local = [t.index_select(0, index) for t in (x, upstream)]
                out, dx, grads = _run(build(chunk, tp, groups), *local, packed)
                got = {"out": out, "dx": dx}
                want = {"out": expected.index_select(0, index), "dx": expected_dx.index_select(0, index)}
                for param, shard in shards.items():
                    total = grads[param].clone()
                    dist.all_reduce(total, group=groups.cp)
                    if shard is None:  # replicated over TP: each TP rank's heads' share
                        if tp > 1:
                            dist.all_reduce(total, group=groups.tp)
                        want[param] = expected_grads[param]
                    else:
                        want[param] = shard_tensor(expected_grads[param], shard[0], shard[1], tp_rank, tp)
                    got[param] = total
                for what in want:
                    if not torch.allclose(got[what], want[what], rtol=1e-4, atol=1e-5):
                        difference = (got[what] - want[what]).abs().max().item()
                        failures.append(f"rank {rank} {kind} {packing} {name} {what}: {difference}")
                checked += 1
    return failures, checked


def test_every_layout_equals_one_process():
    for failures, checked in run_distributed(check_every_layout, 4):
        assert failures == [] and checked == len(MIXERS) * 3 * 3


def _compiled_cp2():
    """Each mixer compiled (torch.compile, as --torch-compile compiles a layer: graph breaks at the
    exchanges) under CP 2: its output and input gradient against the eager single process's."""
    torch._inductor.config.compile_threads = 1  # no compile-worker pool in forked ranks
    groups, differences = ProcessGroupCollection(cp=dist.group.WORLD), []
    gen = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    index = cp_token_index(S, 2, dist.get_rank())
    for build, _ in MIXERS.values():
        expected, expected_dx, _ = _run(build(4), x, upstream, None)
        m = build(4, 1, groups)
        m.compile()
        out, dx, _ = _run(m, x.index_select(0, index), upstream.index_select(0, index), None)
        differences += [(out - expected.index_select(0, index)).abs().max().item(),
                        (dx - expected_dx.index_select(0, index)).abs().max().item()]
    return differences


def test_compiled_mixers_under_context_parallelism():
    for differences in run_distributed(_compiled_cp2, 2, timeout=600):
        assert max(differences) < 1e-5, differences


def test_the_triton_kernels_take_the_exchanged_inputs():
    """The same check on Mamba's and Gated DeltaNet's Triton kernels (Triton's interpreter), rows of 32,
    chunks of 16 (Gated Delta Product runs Gated DeltaNet's rule kernel: tests/ssm/test_gated_delta_product.py
    checks it there)."""
    assert run_in_the_interpreter(__file__, "context_parallel_mixers_cases.py") == "checked 18 layouts"


def test_shares_split_or_repeat_the_groups():
    """Groups split over CP when they are as many or more, else each goes to the ranks whose heads
    read it; sizes that do neither are refused in one line."""
    assert [(list(s.heads), list(s.groups)) for s in head_shares(8, 4, 2, ("heads", "groups", "Mamba"))] == \
        [([0, 1, 2, 3], [0, 1]), ([4, 5, 6, 7], [2, 3])]
    assert [(list(s.heads), list(s.groups)) for s in head_shares(8, 2, 4, ("heads", "groups", "Mamba"))] == \
        [([0, 1], [0]), ([2, 3], [0]), ([4, 5], [1]), ([6, 7], [1])]
    assert channel_index((0, 2, range(1, 3)), (10, 1, range(2))).tolist() == [2, 3, 4, 5, 10, 11]
    with pytest.raises(ValueError, match=r"^Mamba's 6 heads per tensor-parallel rank do not split over "
                                         r"context-parallel size 4; choose"):
        head_shares(6, 2, 4, ("heads", "groups", "Mamba"))
    with pytest.raises(ValueError, match=r"^Gated DeltaNet's 6 key heads per tensor-parallel rank neither split "
                                         r"over context-parallel size 4 nor divide it; choose"):
        head_shares(12, 6, 4, ("value heads", "key heads", "Gated DeltaNet"))


@gpu_test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_both_mixers_over_nccl():
    """CP 2 over NCCL on two GPUs (the Triton kernels, fp32) against one GPU over the whole sequence."""
    script = os.path.join(os.path.dirname(__file__), "nccl_context_parallel_mixers_check.py")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", script], check=True,
                   timeout=600)
