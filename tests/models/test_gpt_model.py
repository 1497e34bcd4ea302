"""GPTModel on one process: outputs, loss, tied weights, position embeddings and input checks."""

import pytest
import torch
import torch.nn.functional as F

from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH = 48, 12, 3


def make_model(seed=0, **kwargs):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    torch.manual_seed(seed)
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, **kwargs)


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.arange(SEQ).expand(BATCH, SEQ), labels


def test_loss_is_cross_entropy_of_the_logits():
    model = make_model()
    ids, pos, labels = batch()
    logits = model(ids, pos)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    loss = model(ids, pos, labels=labels)
    assert loss.shape == (BATCH, SEQ)
    torch.testing.assert_close(loss, expected.view(BATCH, SEQ))
    torch.testing.assert_close(make_model(parallel_output=False)(ids, pos), logits)


def test_tied_output_layer_uses_the_word_embedding():
    model = make_model(share_embeddings_and_output_weights=True)
    assert model.output_layer.weight is None
    emb = model.embedding.word_embeddings.weight
    assert model.shared_embedding_or_output_weight() is emb
    ids, pos, labels = batch()
    hidden = model.decoder(model.embedding(ids, pos))  # [s, b, h]
    torch.testing.assert_close(model(ids, pos), (hidden @ emb.t()).transpose(0, 1))
    model(ids, pos, labels=labels).sum().backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0


def test_position_embedding_types():
    ids, pos, _ = batch()
    learned = make_model()
    assert learned.embedding.position_embeddings.weight.shape == (SEQ, 32)
    shifted = learned(ids, (pos + 1) % SEQ)
    assert not torch.allclose(shifted, learned(ids, pos))
    rope = make_model(position_embedding_type="rope")
    assert not hasattr(rope.embedding, "position_embeddings")
    assert "rotary_pos_emb.inv_freq" not in rope.state_dict()
    # RoPE sees only relative positions: shifting every position changes nothing.
    torch.testing.assert_close(rope(ids, pos + 2), rope(ids, pos), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rope(ids, None), rope(ids, pos))
    none = make_model(position_embedding_type="none")
    torch.testing.assert_close(none(ids, pos + 3), none(ids, pos))
    with pytest.raises(ValueError, match="position_embedding_type"):
        make_model(position_embedding_type="alibi")


def test_bad_inputs_raise_clear_errors():
    ids = torch.zeros(1, SEQ + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_sequence_length"):
        make_model()(ids, torch.arange(SEQ + 1)[None])
    with pytest.raises(ValueError, match="normalization"):
        get_gpt_layer_local_spec(normalization="BatchNorm")


def test_decoder_block_spec_places_moe_layers_by_frequency():
    from teratron.models.gpt import get_gpt_decoder_block_spec
    from teratron.transformer.mlp import MLP
    from teratron.transformer.moe import MoELayer

    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                               moe_router_topk=2, moe_layer_freq=2)
    kinds = [spec.submodules.mlp.module for spec in get_gpt_decoder_block_spec(config, pp_rank=0, pp_size=1).layer_specs]
    assert kinds == [MoELayer, MLP, MoELayer, MLP]
    second_stage = get_gpt_decoder_block_spec(config, pp_rank=1, pp_size=2).layer_specs
    assert [spec.submodules.mlp.module for spec in second_stage] == [MoELayer, MLP]
    dense = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    assert all(spec.submodules.mlp.module is MLP for spec in get_gpt_decoder_block_spec(dense).layer_specs)


def test_same_seed_same_model_different_seed_different_model():
    a, b, c = make_model(seed=3), make_model(seed=3), make_model(seed=4)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embedding.word_embeddings.weight, c.embedding.word_embeddings.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_model_equals_cpu_model_and_runs_in_bf16():
    cpu = make_model(position_embedding_type="rope", share_embeddings_and_output_weights=True)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0)
    gpu = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope",
                   share_embeddings_and_output_weights=True)
    assert all(p.is_cuda for p in gpu.parameters())
    gpu.load_state_dict(cpu.state_dict())
    ids, pos, labels = batch()
    torch.testing.assert_close(gpu(ids.cuda(), pos.cuda()).cpu(), cpu(ids, pos), rtol=1e-4, atol=1e-4)
    cpu_loss, gpu_loss = cpu(ids, pos, labels=labels), gpu(ids.cuda(), pos.cuda(), labels=labels.cuda())
    torch.testing.assert_close(gpu_loss.cpu(), cpu_loss, rtol=1e-4, atol=1e-4)
    cpu_loss.sum().backward()
    gpu_loss.sum().backward()
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-3, atol=1e-5, msg=name)
    bf16 = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, params_dtype=torch.bfloat16,
                             fp32_residual_connection=True, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(bf16, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")
    loss = model(ids.cuda(), pos.cuda(), labels=labels.cuda())
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    loss.mean().backward()
