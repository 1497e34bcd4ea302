"""Column/Row/VocabParallelEmbedding under TP=2 and TP=4, with and without sequence parallelism,
equal the TP=1 layer built from the same seed: outputs, input grads and weight grads. No weight
is copied: layout-invariant initialisation alone makes the models equal. A vocab-sized weight
padded with `padded_vocab_init_method` holds the unpadded layer's rows and zero padding rows.

One 4-rank launch: the TP=1 reference is built before model parallel is initialised; TP=2 uses
parallel_state's group (group=None), TP=4 the world group passed explicitly.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from dist import run_distributed
from teratron import parallel_state
from teratron.model_parallel_config import ModelParallelConfig
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from teratron.tensor_parallel.layers import (padded_vocab_init_method, param_is_not_tensor_parallel_duplicate,
                                            set_tensor_model_parallel_attributes)
from teratron.tensor_parallel.utils import shard_tensor

S, B, H, F_, V = 8, 2, 16, 24, 32
SEED = 1234
STRIDES = (1, 2, (8, 8, 4, 4))  # one part; two equal parts (SwiGLU); unequal parts (Mamba's in_proj)


def _init(w):
    return torch.nn.init.normal_(w, std=0.5)


def _config(tp, sp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SP at TP=1 is switched off with a warning
        return ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)


def _t(seed, shape):
    """A fixed tensor, the same on every rank (drawn on CPU, placed on the default device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, device="cpu").to(torch.get_default_device())


def _build(cls, *args, **kwargs):
    torch.manual_seed(SEED)
    return cls(*args, init_method=_init, **kwargs)


def _forward_backward(layer, x, grad, *, call=None):
    if layer is not None:
        layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(x.is_floating_point())
    out = (call or layer)(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out.detach(), x.grad


def _seq(t, r, n):
    return shard_tensor(t, 0, 1, r, n)


def _check_column(refs, group, r, n, sp):
    x, g = _t(1, (S, B, H)), _t(2, (S, B, F_))
    for stride in STRIDES:
        for gather in (False, True):
            if sp and gather:
                continue
            ref = refs[("column", stride, gather)]
            ref_out, ref_dx = _forward_backward(ref, x, g)
            tp = _build(ColumnParallelLinear, H, F_, config=_config(n, sp), stride=stride,
                        gather_output=gather, tp_group=group)
            assert_close(tp.weight.detach(), shard_tensor(ref.weight.detach(), 0, stride, r, n))
            x_in = _seq(x, r, n) if sp else x
            g_in = g if gather else shard_tensor(g, -1, stride, r, n)
            out, dx = _forward_backward(tp, x_in, g_in)
            assert_close(out, ref_out if gather else shard_tensor(ref_out, -1, stride, r, n))
            assert_close(dx, _seq(ref_dx, r, n) if sp else ref_dx)
            assert_close(tp.weight.grad, shard_tensor(ref.weight.grad, 0, stride, r, n))
            assert_close(tp.bias.grad, shard_tensor(ref.bias.grad, 0, stride, r, n))
            assert (tp.weight.tensor_model_parallel, tp.weight.partition_dim, tp.weight.partition_stride) == \
                (True, 0, stride)
            assert (tp.bias.tensor_model_parallel, tp.bias.partition_dim) == (True, 0)


def _check_row(refs, group, r, n, sp):
    x, g = _t(3, (S, B, F_)), _t(4, (S, B, H))
    for input_is_parallel in (True, False):
        if sp and not input_is_parallel:
            continue
        ref = refs["row"]
        ref_out, ref_dx = _forward_backward(ref, x, g)
        tp = _build(RowParallelLinear, F_, H, config=_config(n, sp), bias=True,
                    input_is_parallel=input_is_parallel, skip_bias_add=False, tp_group=group)
        assert_close(tp.weight.detach(), shard_tensor(ref.weight.detach(), 1, 1, r, n))
        x_in = shard_tensor(x, -1, 1, r, n) if input_is_parallel else x
        out, dx = _forward_backward(tp, x_in, _seq(g, r, n) if sp else g)
        assert_close(out, _seq(ref_out, r, n) if sp else ref_out)
        assert_close(dx, shard_tensor(ref_dx, -1, 1, r, n) if input_is_parallel else ref_dx)
        assert_close(tp.weight.grad, shard_tensor(ref.weight.grad, 1, 1, r, n))
        bias_grad = tp.bias.grad.clone()
        if sp:  # each rank saw only its part of the sequence: finalize_model_grads sums over TP
            dist.all_reduce(bias_grad, group=group or parallel_state.get_tensor_model_parallel_group())
        assert_close(bias_grad, ref.bias.grad)
        assert tp.bias.sequence_parallel == sp and not getattr(tp.bias, "tensor_model_parallel", False)
        assert (tp.weight.tensor_model_parallel, tp.weight.partition_dim) == (True, 1)


def _check_embedding(refs, group, r, n, sp):
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5), device="cpu").to(
        torch.get_default_device())
    g = _t(6, (B, S, H))
    ref = refs["embedding"]
    ref_out, _ = _forward_backward(ref, ids, g)
    for reduce_scatter in ((False, True) if sp else (False,)):
        tp = _build(VocabParallelEmbedding, V, H, config=_config(n, sp),
                    reduce_scatter_embeddings=reduce_scatter, tp_group=group)
        assert_close(tp.weight.detach(), shard_tensor(ref.weight.detach(), 0, 1, r, n))
        if reduce_scatter:  # [b, s, h] -> this rank's [s/tp, b, h]
            out, _ = _forward_backward(tp, ids, _seq(g.transpose(0, 1), r, n))
            assert_close(out, _seq(ref_out.transpose(0, 1), r, n))
        else:
            out, _ = _forward_backward(tp, ids, g)
            assert_close(out, ref_out)
        assert_close(tp.weight.grad, shard_tensor(ref.weight.grad, 0, 1, r, n))


def _mlp(tp, sp, group):
    fc1 = _build(ColumnParallelLinear, H, F_, config=_config(tp, sp), tp_group=group)
    fc2 = _build(RowParallelLinear, F_, H, config=_config(tp, sp), bias=True, input_is_parallel=True,
                 skip_bias_add=False, tp_group=group)
    return fc1, fc2


def _check_mlp_chain(refs, group, r, n):
    """Column (SP all-gather) -> gelu -> Row (SP reduce-scatter) equals the TP=1 MLP."""
    x, g = _t(7, (S, B, H)), _t(8, (S, B, H))
    ref1, ref2 = refs["mlp"]
    ref_out, ref_dx = _forward_backward(None, x, g, call=lambda x: ref2(F.gelu(ref1(x)[0]))[0])
    fc1, fc2 = _mlp(n, True, group)
    out, dx = _forward_backward(None, _seq(x, r, n), _seq(g, r, n), call=lambda x: fc2(F.gelu(fc1(x)[0]))[0])
    assert_close(out, _seq(ref_out, r, n))
    assert_close(dx, _seq(ref_dx, r, n))
    assert_close(fc1.weight.grad, shard_tensor(ref1.weight.grad, 0, 1, r, n))
    assert_close(fc2.weight.grad, shard_tensor(ref2.weight.grad, 1, 1, r, n))
    ref1.zero_grad(set_to_none=True)
    ref2.zero_grad(set_to_none=True)


def _build_refs():
    """TP=1 references; build them before model parallel exists (a group of one)."""
    refs = {("column", s, g): _build(ColumnParallelLinear, H, F_, config=_config(1, False), stride=s,
                                     gather_output=g) for s in STRIDES for g in (False, True)}
    refs["row"] = _build(RowParallelLinear, F_, H, config=_config(1, False), bias=True,
                         input_is_parallel=True, skip_bias_add=False)
    refs["embedding"] = _build(VocabParallelEmbedding, V, H, config=_config(1, False))
    refs["mlp"] = _mlp(1, False, None)
    refs["vocab"] = (refs["embedding"], _build(ColumnParallelLinear, H, V, config=_config(1, False)))
    return refs


def _check_padded_vocab_init(refs, group, r, n):
    """A vocab padded from V to 2V: the real rows are the unpadded layer's (same seed), the
    padding rows zero, under any TP size."""
    init = padded_vocab_init_method(_init, V)
    for ref, cls, sizes in ((refs["vocab"][0], VocabParallelEmbedding, (2 * V, H)),
                            (refs["vocab"][1], ColumnParallelLinear, (H, 2 * V))):
        torch.manual_seed(SEED)
        padded = cls(*sizes, config=_config(n, False), init_method=init, tp_group=group)
        full = torch.cat([ref.weight.detach(), torch.zeros(V, H)])
        assert torch.equal(padded.weight.detach(), shard_tensor(full, 0, 1, r, n)), cls.__name__


def check_layers(refs, group, r, n):
    for sp in (False, True):
        _check_column(refs, group, r, n, sp)
        _check_row(refs, group, r, n, sp)
        _check_embedding(refs, group, r, n, sp)
    _check_mlp_chain(refs, group, r, n)
    _check_padded_vocab_init(refs, group, r, n)


def _check_duplicate_counting(group, r):
    """A TP shard counts on every rank, a replicated parameter on TP rank 0 only."""
    shard, replicated = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    set_tensor_model_parallel_attributes(shard, True, 0, 1)
    assert param_is_not_tensor_parallel_duplicate(shard, group)
    assert param_is_not_tensor_parallel_duplicate(replicated, group) == (r == 0)


def _all_layouts():
    rank = dist.get_rank()
    refs = _build_refs()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    check_layers(refs, None, rank % 2, 2)
    check_layers(refs, dist.group.WORLD, rank, 4)
    _check_duplicate_counting(None, rank % 2)
    _check_duplicate_counting(dist.group.WORLD, rank)
    return True


def test_parallel_layers_equal_tp1_layers():
    assert run_distributed(_all_layouts, 4) == [True] * 4


def test_layer_options_single_process():
    _check_padded_vocab_init(_build_refs(), None, 0, 1)
    assert padded_vocab_init_method(_init, None) is _init
    config = _config(1, False)
    ref = _build(ColumnParallelLinear, H, F_, config=config, keep_master_weight_for_test=True)
    assert_close(ref.master_weight, ref.weight.detach())
    skip = _build(ColumnParallelLinear, H, F_, config=config, skip_bias_add=True)
    x = _t(9, (S, B, H))
    out, bias = skip(x)
    assert bias is skip.bias
    assert_close(out + bias, ref(x)[0])
    # A tied output layer: no weight of its own, the embedding's passed to forward.
    tied = ColumnParallelLinear(H, V, config=config, init_method=_init, bias=False,
                                skip_weight_param_allocation=True)
    assert tied.weight is None
    embedding_weight = _t(10, (V, H))
    assert_close(tied(x, weight=embedding_weight)[0], x @ embedding_weight.T)
    with pytest.raises(RuntimeError, match="weight="):
        tied(x)
    with pytest.raises(RuntimeError, match="shape"):
        tied(x, weight=_t(11, (V + 1, H)))
    row = _build(RowParallelLinear, F_, H, config=config, bias=True, input_is_parallel=True, skip_bias_add=True)
    out, bias = row(_t(12, (S, B, F_)))
    assert bias is row.bias and out.shape == (S, B, H)
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(F_, H, config=_config(2, True), init_method=_init, bias=True,
                          input_is_parallel=False, skip_bias_add=False)
    bf16 = ModelParallelConfig(params_dtype=torch.bfloat16)
    layer = _build(ColumnParallelLinear, H, F_, config=bf16)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    assert_close(layer.weight.float(), ref.weight.detach().bfloat16().float())  # fp32 init, then cast
    embedding = _build(VocabParallelEmbedding, V, H, config=config)
    ids = torch.randint(0, V, (B, S))
    assert_close(embedding(ids), embedding.weight[ids])

