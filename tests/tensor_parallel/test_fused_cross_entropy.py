"""fused_vocab_parallel_cross_entropy (output layer + loss in token chunks) equals the unfused
output layer + vocab_parallel_cross_entropy, and plain single-process autograd, at TP=1, TP=2 and
TP=2 with sequence parallelism: loss and gradients of the hidden states and of the weight, with
and without vocabulary padding and label smoothing, for chunk sizes that do and do not divide
the token count. No tensor with a vocab dim larger than one chunk's logits is ever created.
GPTModel with cross_entropy_loss_fusion (tied and untied output weights, padded vocabulary, TP=1
and TP=2 + SP) gives the unfused model's per-token loss and every parameter's gradient.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dist import run_distributed
from teratron import parallel_state
from teratron.model_parallel_config import ModelParallelConfig
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    pad_vocab_size,
    vocab_parallel_cross_entropy,
)
from teratron.tensor_parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from teratron.tensor_parallel.utils import shard_tensor
from teratron.training.arguments import parse_train_args
from teratron.training.config import run_config_from_args
from teratron.transformer.transformer_config import TransformerConfig

S, B, H, VOCAB = 8, 3, 16, 30  # 24 tokens; VOCAB is padded to 32 (a multiple of 8 x TP)
CHUNKS = (1, 2, 5, 8, 24, 100)  # 5 does not divide 24; 100 is more than the tokens
TIGHT = dict(rtol=1e-6, atol=1e-7)  # fused vs unfused: the same math, only chunked GEMMs
# The CPU BLAS computes 1- and 2-row products with another kernel that sums in another order (a
# few ulps of the logits, ~1e-6 of a small loss): those chunks meet the reference tolerance only.
TIGHT_CHUNKS = (5, 8, 24, 100)


def _t(seed, shape, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _target(vocab):
    return torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(2))


def _reference(hidden, weight, target, alpha, vocab):
    """Plain autograd over the `vocab` real rows of the full weight [V, h]; Megatron's smoothing
    alpha equals torch's alpha * K / (K - 1)."""
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = hidden @ weight[:vocab].t()
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none",
                           label_smoothing=alpha * vocab / (vocab - 1)).view(S, B)
    loss.backward(_t(3, (S, B)))
    return loss.detach(), hidden.grad, weight.grad


def _loss_and_grads(fused, hidden, weight, target, alpha, group, unpadded, chunk, sp):
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    if fused:
        loss = fused_vocab_parallel_cross_entropy(hidden, weight, target, alpha, group, unpadded, chunk,
                                                  sequence_parallel=sp)
    else:  # what ColumnParallelLinear + GPTModel.compute_language_model_loss do
        full = gather_from_sequence_parallel_region(hidden, True, group) if sp else \
            copy_to_tensor_model_parallel_region(hidden, group)
        loss = vocab_parallel_cross_entropy(F.linear(full, weight).float(), target, alpha, group, unpadded)
    loss.backward(_t(3, (S, B)))
    return loss.detach(), hidden.grad, weight.grad


def _check_layout(group, n, r, sp):
    for padded in (False, True):
        vocab = pad_vocab_size(VOCAB, 8, n) if padded else 32
        unpadded = VOCAB if padded else None
        real = VOCAB if padded else vocab
        target = _target(real)
        hidden = _t(1, (S, B, H))
        weight = _t(4, (vocab, H), 2.0)  # padding rows nonzero: they must still be excluded
        hidden_in = shard_tensor(hidden, 0, 1, r, n) if sp else hidden
        weight_in = shard_tensor(weight, 0, 1, r, n)
        for alpha in (0.0, 0.1):
            ref_loss, ref_dh, ref_dw = _reference(hidden, weight, target, alpha, real)
            ref_dw = torch.cat([ref_dw[:real], torch.zeros(vocab - real, H)])
            unfused = _loss_and_grads(False, hidden_in, weight_in, target, alpha, group, unpadded, None, sp)
            assert_close(unfused[0], ref_loss)
            for chunk in CHUNKS:
                loss, dh, dw = _loss_and_grads(True, hidden_in, weight_in, target, alpha, group, unpadded,
                                               chunk, sp)
                assert loss.dtype == torch.float32 and loss.shape == (S, B)
                for got, want in zip((loss, dh, dw), unfused):
                    assert_close(got, want, **(TIGHT if chunk in TIGHT_CHUNKS else {}))
                assert_close(loss, ref_loss)
                assert_close(dh, shard_tensor(ref_dh, 0, 1, r, n) if sp else ref_dh)
                assert_close(dw, shard_tensor(ref_dw, 0, 1, r, n))
                if padded:
                    is_padding = shard_tensor(torch.arange(vocab), 0, 1, r, n) >= VOCAB
                    assert torch.all(dw[is_padding] == 0)


def _gpt_config(tp, sp, fusion):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32,
                             hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                             tensor_model_parallel_size=tp, sequence_parallel=sp,
                             cross_entropy_loss_fusion=fusion)


def _gpt_loss_and_grads(tp, sp, fusion, tied):
    torch.manual_seed(0)
    model = GPTModel(_gpt_config(tp, sp, fusion), get_gpt_layer_local_spec(), pad_vocab_size(VOCAB, 8, tp), S,
                     share_embeddings_and_output_weights=tied, unpadded_vocab_size=VOCAB)
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)
    loss = model(ids, None, labels=labels)
    assert loss.shape == (B, S)
    loss.backward(_t(6, (B, S)))
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _check_gpt(tp, sp):
    for tied in (False, True):
        fused_loss, fused_grads = _gpt_loss_and_grads(tp, sp, True, tied)
        loss, grads = _gpt_loss_and_grads(tp, sp, False, tied)
        assert_close(fused_loss, loss, **TIGHT)
        assert fused_grads.keys() == grads.keys()
        for name in grads:
            assert_close(fused_grads[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)


def _all_layouts():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group, r = parallel_state.get_tensor_model_parallel_group(), dist.get_rank()
    singles = [dist.new_group([i]) for i in range(dist.get_world_size())]
    _check_layout(singles[r], 1, 0, sp=False)
    _check_layout(group, 2, r, sp=False)
    _check_layout(group, 2, r, sp=True)
    _check_gpt(2, sp=True)


def test_fused_equals_unfused_and_reference_at_tp1_tp2_and_sp():
    run_distributed(_all_layouts, world_size=2)


def test_gpt_model_fused_loss_and_grads_equal_unfused_single_process():
    _check_gpt(1, sp=False)


class _LargestTensor(TorchDispatchMode):
    """Records the largest numel among the tensors any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def _largest_tensor_created(fused, chunk):
    vocab = 40
    hidden = _t(1, (S, B, H)).requires_grad_(True)
    weight = _t(4, (vocab, H)).requires_grad_(True)
    target = _target(VOCAB)
    with _LargestTensor() as mode:
        if fused:
            loss = fused_vocab_parallel_cross_entropy(hidden, weight, target, 0.1, unpadded_vocab_size=VOCAB,
                                                      chunk_size=chunk)
        else:
            loss = vocab_parallel_cross_entropy(F.linear(hidden, weight), target, 0.1, unpadded_vocab_size=VOCAB)
        loss.sum().backward()
    return mode.largest, vocab


@pytest.mark.parametrize("chunk", [2, 5])
def test_no_tensor_is_larger_than_one_chunk_of_logits(chunk):
    largest, vocab = _largest_tensor_created(True, chunk)
    # The weight and its grad [V, h] and the hidden states [s*b, h] are inputs' sizes; any
    # logits-like tensor must stay within [chunk, V].
    bound = max(chunk * vocab, vocab * H, S * B * H)
    assert bound < S * B * vocab  # the full logits would break the bound
    assert largest <= bound
    unfused_largest, _ = _largest_tensor_created(False, chunk)
    assert unfused_largest == S * B * vocab  # the check sees the unfused path's full logits


def test_config_and_flags():
    assert ModelParallelConfig(cross_entropy_loss_fusion=True).cross_entropy_loss_fusion
    with pytest.raises(ValueError, match="cross_entropy_fusion_impl"):
        ModelParallelConfig(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    with pytest.raises(ValueError, match="chunk_size"):
        fused_vocab_parallel_cross_entropy(_t(1, (S, B, H)), _t(4, (32, H)), _target(32), chunk_size=0)
    args = parse_train_args(["--cross-entropy-loss-fusion"])  # over the demo defaults
    assert run_config_from_args(args, world_size=1, vocab_size=64).transformer.cross_entropy_loss_fusion
