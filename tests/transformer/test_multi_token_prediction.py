"""Multi-token prediction against a plain-PyTorch computation written here, and its config rules.

The reference takes the main model's output h_0 (read from the decoder) and the MTP weights,
and computes each depth as DeepSeek-V3 / Megatron define it: RMSNorm the embeddings of the
tokens k ahead and h_{k-1}, concatenate, project, one pre-norm transformer layer (causal
multi-head attention with RoPE, SwiGLU), the depth's final norm and the tied output layer;
cross entropy against the labels k ahead, the last k positions masked. The model's logged
[sum, count] per depth and its MTP parameters' gradients must equal the reference's.
"""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.transformer.moe import MoEAuxLossAutoScaler
from teratron.transformer.multi_token_prediction import pop_mtp_losses
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH, HIDDEN, HEADS, FFN = 40, 12, 2, 32, 4, 48


def make_config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
                  hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2, use_cpu_initialization=True,
                  mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build(config, tied=True):
    torch.manual_seed(3)
    return build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                          position_embedding_type="rope",
                                          share_embeddings_and_output_weights=tied, padded_vocab_size=VOCAB))


def batch():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.25).float()
    return ids, labels, mask


# ----- the reference ----------------------------------------------------------------------------

def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions):
    """x [b, s, heads, d]; Llama's rotation of channel pairs (i, i + d/2)."""
    d = x.shape[-1]
    angles = positions[:, :, None].float() * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))  # [b, s, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, :, None], torch.cat([angles, angles], -1).sin()[:, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def transformer_layer(x, p, positions):
    """x [b, s, h]; p: the layer's weights by name."""
    b, s, h = x.shape
    hn = h // HEADS
    qkv = (rms_norm(x, p["input_layernorm.weight"]) @ p["self_attention.linear_qkv.weight"].T)
    q, k, v = qkv.view(b, s, HEADS, 3 * hn).split(hn, dim=-1)  # MHA: per head [q, k, v]
    q, k = rope(q, positions), rope(k, positions)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / hn ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, h)
    x = x + context @ p["self_attention.linear_proj.weight"].T
    gate, up = (rms_norm(x, p["pre_mlp_layernorm.weight"]) @ p["mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ p["mlp.linear_fc2.weight"].T


def shift(t, k):
    out = torch.zeros_like(t)
    out[:, :SEQ - k] = t[:, k:]
    return out


def reference_mtp(weights, embedding, h0, ids, labels, mask, depths):
    """Per depth (masked loss sum, count), from h0 [b, s, h] and the MTP weights."""
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    hidden, out = h0, []
    for k in range(1, depths + 1):
        p = {name[len(f"mtp.layers.{k - 1}."):]: w for name, w in weights.items()
             if name.startswith(f"mtp.layers.{k - 1}.")}
        e = embedding[shift(ids, k)]
        x = torch.cat([rms_norm(e, p["enorm.weight"]), rms_norm(hidden, p["hnorm.weight"])], -1) @ p["eh_proj.weight"].T
        layer = {name[len("transformer_layer."):]: w for name, w in p.items() if name.startswith("transformer_layer.")}
        hidden = rms_norm(transformer_layer(x, layer, positions), p["final_layernorm.weight"])
        token_loss = F.cross_entropy((hidden @ embedding.T).reshape(-1, VOCAB), shift(labels, k).reshape(-1),
                                     reduction="none").view(BATCH, SEQ)
        out.append((torch.sum(token_loss * shift(mask, k)), shift(mask, k).sum()))
    return out


# ----- tests ------------------------------------------------------------------------------------

def check_against_reference(config, depths, reference_name=lambda name: name):
    """The model's logged [sum, count] per depth and its MTP gradients equal the reference's, whose
    weights are the model's MTP parameters under `reference_name`; returns (LM loss, ids, labels)."""
    model = build(config)
    ids, labels, mask = batch()
    h0 = {}
    model.decoder.register_forward_hook(lambda module, args, output: h0.setdefault("h", output))
    MoEAuxLossAutoScaler.set_loss_scale(None)  # backward scale 1, as for a lone model
    pop_mtp_losses()
    lm_loss = model(ids, None, labels=labels, loss_mask=mask)
    logged = pop_mtp_losses()
    (lm_loss * mask).sum().backward()

    weights = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()
               if name.startswith("mtp.")}
    renamed = {reference_name(name): w for name, w in weights.items()}
    assert len(renamed) == len(weights)  # no two parameters under one reference name
    embedding = model.embedding.word_embeddings.weight.detach()
    reference = reference_mtp(renamed, embedding, h0["h"].detach().transpose(0, 1), ids, labels, mask, depths)
    assert len(logged) == depths
    for k, ((ref_sum, ref_count), report) in enumerate(zip(reference, logged), 1):
        assert report[1].item() == ref_count.item() == mask[:, k:].sum().item()
        torch.testing.assert_close(report[0], ref_sum.detach(), rtol=1e-5, atol=1e-5)
    # The gradient: the mean over depths of each depth's masked mean, times the scaling factor.
    total = sum(loss_sum / count for loss_sum, count in reference) * (config.mtp_loss_scaling_factor / depths)
    total.backward()
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            torch.testing.assert_close(p.grad, weights[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    return lm_loss, ids, labels


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_equals_the_plain_pytorch_computation(depths):
    config = make_config(mtp_num_layers=depths)
    lm_loss, ids, labels = check_against_reference(config, depths)
    # The LM loss itself is the plain one: the MTP loss joins only its backward.
    without = build(dataclasses.replace(config, mtp_num_layers=None, mtp_loss_scaling_factor=None))
    torch.testing.assert_close(lm_loss, without(ids, None, labels=labels))


@pytest.mark.parametrize("depths", [1, 2])
def test_hybrid_mtp_depths_equal_the_plain_pytorch_computation(depths):
    """A hybrid pattern's '/' depths: "*-/*-" runs an attention layer then an MLP layer per depth, the
    computation of the reference's one transformer layer (weights renamed from the stack's)."""
    config = make_config(num_layers=2, hybrid_layer_pattern="*-" + "/*-" * depths, mtp_num_layers=depths)
    check_against_reference(config, depths, lambda name: re.sub(r"transformer_layer\.layers\.[01]\.",
                                                                 "transformer_layer.", name))


def test_mtp_reaches_the_main_model_and_not_without_its_loss():
    """With labels the MTP loss trains the main model too (h_0 and the shared embedding);
    without labels the model returns the main logits and runs no MTP layer."""
    model = build(make_config())
    ids, labels, mask = batch()
    MoEAuxLossAutoScaler.set_loss_scale(None)
    model(ids, None, labels=labels, loss_mask=torch.zeros_like(mask)).sum().backward()  # LM loss masked out
    assert model.decoder.layers[0].mlp.linear_fc1.weight.grad.abs().sum() > 0
    assert model.embedding.word_embeddings.weight.grad.abs().sum() > 0
    pop_mtp_losses()
    logits = model(ids, None)
    assert logits.shape == (BATCH, SEQ, VOCAB) and pop_mtp_losses() == []


def test_untied_output_layer_and_names():
    model = build(make_config(mtp_num_layers=1), tied=False)
    names = {name for name, _ in model.named_parameters()}
    assert {"output_layer.weight", "mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight",
            "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"} <= names
    assert model.mtp.layers[0].eh_proj.weight.shape == (HIDDEN, 2 * HIDDEN)
    assert model.mtp.layers[0].transformer_layer.layer_number == 2  # num_layers + depth


def test_freeze_base_model_for_mtp_leaves_only_the_mtp_layers_trainable():
    model = build(make_config(freeze_base_model_for_mtp=True))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith("mtp.layers.") for name in trainable)
    assert trainable == {name for name, _ in model.named_parameters() if name.startswith("mtp.")}
    ids, labels, mask = batch()
    model.train()
    loss = model(ids, None, labels=labels, loss_mask=mask)
    loss.sum().backward()
    assert all(p.grad is None for name, p in model.named_parameters() if not name.startswith("mtp."))
    assert all(p.grad is not None for name, p in model.named_parameters() if name.startswith("mtp."))


def test_mtp_layers_are_built_like_the_last_layer():
    """Per-layer attention patterns give an MTP layer the last decoder layer's entry (layer 3 of 3
    here: windowed, NoPE, where numbers 4 and 5 would say full attention and index past the
    NoPE list); with multi-latent attention the MTP layers are MLA layers."""
    from teratron.transformer.multi_latent_attention import MLASelfAttention
    from teratron.transformer.transformer_config import MLATransformerConfig

    model = build(make_config(num_layers=3, window_size=(3, 0), window_attn_skip_freq=2, no_rope_freq=[0, 0, 1]))
    last = model.decoder.layers[-1].self_attention
    assert (last.core_attention.window_size, last.apply_rope) == ((3, 0), False)
    assert model.decoder.layers[1].self_attention.core_attention.window_size is None  # layer 2: full
    for layer in model.mtp.layers:
        attention = layer.transformer_layer.self_attention
        assert (attention.core_attention.window_size, attention.apply_rope) == ((3, 0), False)
    ids, labels, mask = batch()
    assert model(ids, None, labels=labels, loss_mask=mask).shape == (BATCH, SEQ)
    mla = MLATransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                               q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               mtp_num_layers=2)
    model = build(mla)
    assert all(isinstance(layer.transformer_layer.self_attention, MLASelfAttention) for layer in model.mtp.layers)
    assert model(ids, None, labels=labels, loss_mask=mask).shape == (BATCH, SEQ)


@pytest.mark.parametrize("overrides, error, message", [
    (dict(mtp_num_layers=0), ValueError, r"mtp_num_layers must be a positive integer or None, got 0"),
    (dict(mtp_num_layers=None, mtp_loss_scaling_factor=0.1), ValueError,
     r"mtp_loss_scaling_factor is set but mtp_num_layers is None"),
    (dict(mtp_num_layers=None, mtp_loss_scaling_factor=None, freeze_base_model_for_mtp=True), ValueError,
     r"freeze_base_model_for_mtp is set but mtp_num_layers is None"),
    (dict(mtp_loss_scaling_factor=-1.0), ValueError, r"mtp_loss_scaling_factor must be >= 0"),
    (dict(fp8="hybrid", fp8_recipe="tensorwise", bf16=True, params_dtype=torch.bfloat16), NotImplementedError,
     r"mtp_num_layers with fp8='hybrid': multi-token prediction is not built for FP8 yet"),
    (dict(num_layers=2, pipeline_model_parallel_size=2, freeze_base_model_for_mtp=True), NotImplementedError,
     r"freeze_base_model_for_mtp needs pipeline_model_parallel_size 1"),
])
def test_config_errors(overrides, error, message):
    with pytest.raises(error, match=message):
        make_config(**overrides)


def test_defaults_and_learned_positions():
    assert make_config(mtp_loss_scaling_factor=None).mtp_loss_scaling_factor == 0.1  # Megatron's default
    with pytest.raises(ValueError, match=r"mtp_num_layers needs position_embedding_type 'rope' or 'none'"):
        GPTModelConfig(make_config(), vocab_size=VOCAB, max_position_embeddings=SEQ)


# ----- the shift: within documents, and along the whole sequence under context parallelism --------

def _documents_params(documents):
    from teratron.packed_seq_params import PackedSeqParams, cu_seqlens_from_documents

    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens_from_documents(documents))


def _rolled_by_hand(values, shift, documents=None):
    """Position j gets j + shift's value when that exists and (with documents) shares j's document."""
    out = torch.zeros_like(values)
    for row in range(values.shape[0]):
        for j in range(values.shape[1] - shift):
            doc = documents[row] if documents is not None else None
            if doc is None or doc[j] == doc[j + shift]:
                out[row, j] = values[row, j + shift]
    return out


@pytest.mark.parametrize("shift", [1, 2, 12])
def test_roll_left_stays_inside_each_document(shift):
    from teratron.transformer.multi_token_prediction import roll_left

    values = torch.arange(1, 2 * 12 + 1).view(2, 12)
    documents = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 12])
    assert torch.equal(roll_left(values, shift), _rolled_by_hand(values, shift))
    assert torch.equal(roll_left(values, shift, attention_mask=_documents_params(documents)),
                       _rolled_by_hand(values, shift, documents))


def _roll_on_cp_ranks():
    """Every CP 2 / CP 4 rank rolls its tokens (2 x CP chunks; packed documents too) and gets its
    tokens of the whole sequence rolled."""
    import torch.distributed as dist

    from teratron.transformer.context_parallel import cp_token_index
    from teratron.transformer.multi_token_prediction import roll_left

    rank, failures = dist.get_rank(), []
    groups = {2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2], 4: dist.new_group([0, 1, 2, 3])}
    values = torch.arange(1, 2 * 16 + 1).view(2, 16)
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [3] * 16])
    for cp_size, group in groups.items():
        index = cp_token_index(16, cp_size, rank % cp_size)
        for docs in (None, documents):
            mask = None if docs is None else _documents_params(docs)
            for shift in (1, 3):
                got = roll_left(values.index_select(1, index), shift, group, mask)
                wanted = _rolled_by_hand(values, shift, docs).index_select(1, index)
                if not torch.equal(got, wanted):
                    failures.append((cp_size, docs is not None, shift, got.tolist(), wanted.tolist()))
    return failures


def test_roll_left_under_context_parallelism_is_the_whole_sequence_roll():
    from dist import run_distributed

    assert run_distributed(_roll_on_cp_ranks, 4) == [[]] * 4
