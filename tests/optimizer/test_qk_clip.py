"""QK-clip's optimizer side: `scale_param_rows` scales rows of the main params (whole or a
distributed-optimizer slice cutting rows) and refreshes the model params from them (fp32, bf16
with fp32 masters, DP=2 distributed optimizer); and a GPT step with QKClip scales the query and
key weights of the groups whose max logit (computed here from the attention inputs) exceeds the
threshold by (threshold / max) ** alpha and ** (1 - alpha), leaving the others untouched; on a
multi-latent-attention model, whose MTP layer is MLA too, the rows of Megatron's MLA rule per head
(queries' RoPE rows by eta, values and down projections untouched), the MTP layer's included; an
attention without `qk_clip_scales` is refused."""

import math

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from teratron.optimizer import OptimizerConfig, get_megatron_optimizer
from teratron.optimizer.optimizer import _scale_rows_of_flat
from teratron.optimizer.qk_clip import QKClip
from teratron.training.build import build_qk_clip
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.transformer_config import MLATransformerConfig, TransformerConfig

ROWS, COLS = 40, 13


class _Config:
    calculate_per_token_loss = False


def test_scale_rows_of_any_flat_slice():
    rows, per_row = 5, 4
    factors = torch.arange(2.0, 2.0 + rows)
    full = torch.randn(rows, per_row)
    expected = (full * factors[:, None]).reshape(-1)
    for start in range(rows * per_row + 1):
        for end in range(start, rows * per_row + 1):
            piece = full.reshape(-1)[start:end].clone()
            _scale_rows_of_flat(piece, start, per_row, factors)
            assert torch.equal(piece, expected[start:end]), (start, end)


def _linear(dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(COLS, ROWS).to(dtype)  # weight [40, 13], bias [40]


def _factors():
    return torch.linspace(0.5, 1.0, ROWS)


def _step_with_scaling(model, module, optimizer):
    """One step at lr 0 (the params stay) whose param-update hook scales weight and bias rows."""
    factors = _factors()
    optimizer.register_param_update_hook(
        lambda opt: opt.scale_param_rows({model.weight: factors, model.bias: factors}))
    optimizer.zero_grad()
    module(torch.randn(3, COLS, dtype=model.weight.dtype)).float().square().sum().backward()
    if module is not model:
        finalize_model_grads([module])
    assert optimizer.step()[0]


def _expected(before, dtype):
    """fp32 rows times their factors, rounded to the params' dtype (the master's copy)."""
    factors = _factors()
    weight, bias = before
    return (weight.float() * factors[:, None]).to(dtype), (bias.float() * factors).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_param_rows_single_process(dtype):
    model = _linear(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.0, bf16=dtype == torch.bfloat16), [model])
    _step_with_scaling(model, model, optimizer)
    for param, expected in zip((model.weight, model.bias), _expected(before, dtype)):
        assert torch.equal(param.detach(), expected)
    for shard in optimizer.main_param_shards():  # the fp32 masters hold the unrounded products
        if shard.model_param is model.weight:
            assert torch.equal(shard.main_param.detach(), before[0].float() * _factors()[:, None])


def _distributed_scaling(dtype):
    parallel_state.initialize_model_parallel()  # DP = 2
    model = _linear(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.0, bf16=dtype == torch.bfloat16), [ddp])
    _step_with_scaling(model, ddp, optimizer)
    ranges = {id(s.model_param): s.flat_range for s in optimizer.main_param_shards()}
    masters = {id(s.model_param): s.main_param.detach().clone() for s in optimizer.main_param_shards()}
    after = [p.detach().clone() for p in model.parameters()]
    return before, after, ranges[id(model.weight)], masters[id(model.weight)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_param_rows_distributed_optimizer(dtype):
    results = run_distributed(_distributed_scaling, 2, dtype)
    before = results[0][0]
    expected = _expected(before, dtype)
    (_, _, range0, _), (_, _, range1, _) = results
    assert range0[1] == range1[0] and range0[1] % COLS  # the slices of the weight cut a row
    for _, after, (start, end), master in results:
        for param, want in zip(after, expected):
            assert torch.equal(param, want)  # every rank: its slice and the all-gathered rest
        assert torch.equal(master, (before[0].float() * _factors()[:, None]).reshape(-1)[start:end])


# ----- a GPT step with QK-clip ------------------------------------------------------------------

SEQ, BATCH, VOCAB, ALPHA = 12, 2, 48, 0.3


def _gpt(**kwargs):
    config = TransformerConfig(**{**dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, add_bias_linear=False, init_method_std=0.3, qk_clip=True,
        qk_clip_alpha=ALPHA), **kwargs})
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")


def _record_qk(model):
    """The query and key inputs of every core attention, per layer, as the forward passes them."""
    seen = []
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.register_forward_pre_hook(
            lambda module, args: seen.append((args[0].detach().clone(), args[1].detach().clone())))
    return seen


def _group_max_logits(query, key, scale):
    """[ng] largest causal logit of each query group, from the full score matrix: q [s, b, np, hn]."""
    q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)  # [b, n, s, hn]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("bnqd,bnkd->bnqk", q, k) * scale
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    per_head = scores.masked_fill(~causal, -float("inf")).amax(dim=(0, 2, 3))
    return per_head.view(key.shape[2], -1).amax(dim=1)


def test_a_step_clips_the_query_and_key_rows_of_the_groups_over_the_threshold():
    model = _gpt()
    seen = _record_qk(model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.0), [model])  # lr 0: only the clip moves weights
    qk_clip = QKClip([model], model.config)
    optimizer.register_param_update_hook(qk_clip.clip)
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    model(ids, torch.arange(SEQ).expand(BATCH, SEQ), labels=labels).sum().backward()
    scale = model.decoder.layers[0].self_attention.core_attention.softmax_scale
    group_max = [_group_max_logits(q, k, scale) for q, k in seen]  # per layer [ng]
    # A threshold with groups on both sides of it.
    threshold = torch.cat(group_max).sort().values[1:3].mean().item()
    model.config.qk_clip_threshold = threshold
    before = [layer.self_attention.linear_qkv.weight.detach().clone() for layer in model.decoder.layers]

    largest = qk_clip.reduce()
    torch.testing.assert_close(largest, torch.cat(group_max).max(), rtol=1e-6, atol=0)
    assert optimizer.step()[0]

    clipped = 0
    for layer, old, maxima in zip(model.decoder.layers, before, group_max):
        weight = layer.self_attention.linear_qkv.weight.detach().view(2, 4, 8, 32)  # [ng, 2 q + k + v heads, hn, h]
        old = old.view(2, 4, 8, 32)
        for group, logit in enumerate(maxima.tolist()):
            if logit <= threshold:
                assert torch.equal(weight[group], old[group])
                continue
            clipped += 1
            eta = threshold / logit
            torch.testing.assert_close(weight[group, :2], old[group, :2] * eta ** ALPHA, rtol=1e-6, atol=0)
            torch.testing.assert_close(weight[group, 2], old[group, 2] * eta ** (1 - ALPHA), rtol=1e-6, atol=0)
            assert torch.equal(weight[group, 3], old[group, 3])  # values
    assert 0 < clipped < 4
    # The records were taken: the next step's maxima start afresh.
    for layer in model.decoder.layers:
        record = layer.self_attention.core_attention.current_max_attn_logits
        assert torch.equal(record, torch.full((4,), -float("inf")))
    # After the clip, the first layer (whose input the clip leaves unchanged) has on the same batch
    # the threshold as the largest logit of each clipped group, and the old one elsewhere.
    seen.clear()
    with torch.no_grad():
        model(ids, torch.arange(SEQ).expand(BATCH, SEQ))
    assert (group_max[0] > threshold).any() and (group_max[0] <= threshold).any()
    after = _group_max_logits(*seen[0], scale)
    torch.testing.assert_close(after, torch.minimum(group_max[0], torch.tensor(threshold)), rtol=1e-5, atol=0)


def test_log_max_attention_logit_alone_does_not_clip():
    model = _gpt(qk_clip=False, qk_clip_alpha=0.5, log_max_attention_logit=True)
    model.config.qk_clip_threshold = 1e-3  # every head is far over it: a clip would change every q/k row
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.0), [model])
    qk_clip = build_qk_clip([model], optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(ids, torch.arange(SEQ).expand(BATCH, SEQ), labels=ids).sum().backward()
    assert qk_clip.reduce().item() > 1.0
    assert optimizer.step()[0]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ----- a GPT step with QK-clip on multi-latent attention (and its MTP layer) -----------------

MLA_DIMS = dict(qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5)


def _mla_gpt(q_lora_rank):
    """Two MLA layers and one MTP depth (an MLA layer too), YaRN with mscale_all_dim (so the softmax
    scale is not 1 / sqrt(head size)) and the latent norms."""
    config = MLATransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=10, **MLA_DIMS,
        rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=8, mscale=0.9,
        mscale_all_dim=0.6, qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        ffn_hidden_size=48, use_cpu_initialization=True, init_method_std=0.3, mtp_num_layers=1, qk_clip=True,
        qk_clip_alpha=ALPHA)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True)
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(config))


def _mla_attentions(model):
    layers = list(model.decoder.layers) + [depth.transformer_layer for depth in model.mtp.layers]
    return [layer.self_attention for layer in layers]


def _mla_softmax_scale(config):
    """DeepSeek's: mscale(mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)."""
    mscale = 0.1 * config.mscale_all_dim * math.log(config.rotary_scaling_factor) + 1
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def _head_max_logits(query, key, scale):
    """[np] largest causal logit of each head, from the full score matrix: q, k [s, b, np, hd]."""
    scores = torch.einsum("qbnd,kbnd->bnqk", query, key) * scale
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, -float("inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_a_step_clips_the_mla_rows_of_the_heads_over_the_threshold(q_lora_rank):
    model = _mla_gpt(q_lora_rank)
    attentions = _mla_attentions(model)
    seen = []
    for attention in attentions:
        attention.core_attention.register_forward_pre_hook(
            lambda module, args: seen.append((args[0].detach().clone(), args[1].detach().clone())))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.0), [model])  # lr 0: only the clip moves weights
    qk_clip = QKClip([model], model.config)
    assert qk_clip.attentions == attentions  # the MTP layer's attention included
    optimizer.register_param_update_hook(qk_clip.clip)
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    model(ids, torch.arange(SEQ).expand(BATCH, SEQ), labels=labels).sum().backward()
    scale = _mla_softmax_scale(model.config)
    head_max = [_head_max_logits(q, k, scale) for q, k in seen]  # per attention [np]
    assert len(head_max) == 3
    for attention, maxima in zip(attentions, head_max):  # the records: RoPE part and MLA's softmax scale in
        torch.testing.assert_close(attention.core_attention.current_max_attn_logits, maxima, rtol=1e-6, atol=0)
    threshold = head_max[0].sort().values[1:3].mean().item()  # the first layer's heads on both sides of it
    model.config.qk_clip_threshold = threshold
    query_name = "linear_q_proj" if q_lora_rank is None else "linear_q_up_proj"
    clipped_names = {f"{query_name}.weight", "linear_kv_up_proj.weight"}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    largest = qk_clip.reduce()
    torch.testing.assert_close(largest, torch.cat(head_max).max(), rtol=1e-6, atol=0)
    assert optimizer.step()[0]

    dn, dr, dv = MLA_DIMS["qk_head_dim"], MLA_DIMS["qk_pos_emb_head_dim"], MLA_DIMS["v_head_dim"]
    clipped = 0
    for attention, maxima in zip(attentions, head_max):
        query = getattr(attention, query_name).weight.detach().view(4, dn + dr, -1)  # [np, q rows, in]
        kv_up = attention.linear_kv_up_proj.weight.detach().view(4, dn + dv, -1)  # [np, k and v rows, d_c]
        old_query = before[_name_of(model, getattr(attention, query_name).weight)].view_as(query)
        old_kv_up = before[_name_of(model, attention.linear_kv_up_proj.weight)].view_as(kv_up)
        for head, logit in enumerate(maxima.tolist()):
            if logit <= threshold:
                assert torch.equal(query[head], old_query[head]) and torch.equal(kv_up[head], old_kv_up[head])
                continue
            clipped += 1
            eta = threshold / logit
            torch.testing.assert_close(query[head, :dn], old_query[head, :dn] * eta ** ALPHA, rtol=1e-6, atol=0)
            torch.testing.assert_close(query[head, dn:], old_query[head, dn:] * eta, rtol=1e-6, atol=0)
            torch.testing.assert_close(kv_up[head, :dn], old_kv_up[head, :dn] * eta ** (1 - ALPHA), rtol=1e-6,
                                       atol=0)
            assert torch.equal(kv_up[head, dn:], old_kv_up[head, dn:])  # values
    assert 0 < clipped < 12 and (head_max[2] > threshold).any()  # the MTP layer's heads clip too
    for name, param in model.named_parameters():  # the down projections (shared RoPE key) and the rest
        if name.rsplit("self_attention.", 1)[-1] not in clipped_names:
            assert torch.equal(param.detach(), before[name]), name
    # After the clip the first layer (whose input the clip leaves unchanged) has on the same batch
    # the threshold as the largest logit of each clipped head, RoPE part included.
    seen.clear()
    with torch.no_grad():
        model(ids, torch.arange(SEQ).expand(BATCH, SEQ))
    assert (head_max[0] > threshold).any() and (head_max[0] <= threshold).any()
    after = _head_max_logits(*seen[0], scale)
    torch.testing.assert_close(after, torch.minimum(head_max[0], torch.tensor(threshold)), rtol=1e-5, atol=0)


def _name_of(model, param):
    return next(name for name, p in model.named_parameters() if p is param)


def test_an_attention_without_qk_clip_scales_is_refused():
    """A custom attention spec whose core attention records max logits but which does not say how
    to clip its weights."""
    config = _gpt().config

    class PlainAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.core_attention = DotProductAttention(config, layer_number=1)

    with pytest.raises(NotImplementedError, match="PlainAttention does not say how to clip"):
        QKClip([torch.nn.Sequential(PlainAttention())], config)
