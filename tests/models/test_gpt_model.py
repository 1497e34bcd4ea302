"""GPTModel on one process: outputs, loss, tied weights, position embeddings, input checks, and
vocabulary padding (a model padded to any size equals the unpadded model, built from the same
seed: weights, logits, loss, gradients and training)."""

import pytest
import torch
import torch.nn.functional as F

from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH = 48, 12, 3


def make_model(seed=0, vocab=VOCAB, **kwargs):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    torch.manual_seed(seed)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab, SEQ, **kwargs)


def batch(vocab=VOCAB):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
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


# ----- vocabulary padding -----------------------------------------------------------------------

REAL_VOCAB = 100
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def test_padded_model_equals_unpadded_model():
    """Padded to 128 or 256, a model with unpadded_vocab_size=100 is the 100-token model: real
    rows drawn as the unpadded model draws them, padding rows zero, logits -inf past 100, the
    same loss and real-row gradients, and exactly zero gradient on padding rows."""
    ids, pos, labels = batch(REAL_VOCAB)
    weights = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(2))
    for kwargs in ({}, dict(share_embeddings_and_output_weights=True, position_embedding_type="rope")):
        ref = make_model(vocab=REAL_VOCAB, **kwargs)
        ref_logits = ref(ids, pos)
        ref_loss = ref(ids, pos, labels=labels)
        (ref_loss * weights).sum().backward()
        ref_params = dict(ref.named_parameters())
        for padded in (128, 256):
            model = make_model(vocab=padded, unpadded_vocab_size=REAL_VOCAB, **kwargs)
            for name, p in model.named_parameters():
                if name in VOCAB_ROWS:
                    assert p.shape[0] == padded
                    assert torch.equal(p[:REAL_VOCAB], ref_params[name]), name
                    assert torch.all(p[REAL_VOCAB:] == 0), name
                else:
                    assert torch.equal(p, ref_params[name]), name
            logits = model(ids, pos)
            assert logits.shape == (BATCH, SEQ, padded)
            assert torch.all(logits[..., REAL_VOCAB:] == float("-inf"))
            torch.testing.assert_close(logits[..., :REAL_VOCAB], ref_logits)
            loss = model(ids, pos, labels=labels)
            torch.testing.assert_close(loss, ref_loss)
            # The returned logits give the same loss to a user's own cross entropy.
            torch.testing.assert_close(F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"), loss)
            (loss * weights).sum().backward()
            for name, p in model.named_parameters():
                if name in VOCAB_ROWS:
                    torch.testing.assert_close(p.grad[:REAL_VOCAB], ref_params[name].grad, msg=name)
                    assert torch.all(p.grad[REAL_VOCAB:] == 0), name
                else:
                    torch.testing.assert_close(p.grad, ref_params[name].grad, msg=name)


def test_last_stage_copy_of_a_tied_padded_embedding_starts_equal_to_it():
    first = make_model(vocab=128, unpadded_vocab_size=REAL_VOCAB, share_embeddings_and_output_weights=True)
    last = make_model(vocab=128, unpadded_vocab_size=REAL_VOCAB, share_embeddings_and_output_weights=True,
                      pre_process=False)
    assert last.output_layer.weight.shared_embedding
    assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
    assert torch.all(last.output_layer.weight[REAL_VOCAB:] == 0)


def _train(model, steps=6):
    ids, pos, labels = batch(REAL_VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(ids, pos, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def test_padding_rows_stay_zero_in_training_and_the_loss_curve_ignores_the_padding():
    reference = _train(make_model(vocab=REAL_VOCAB))
    assert reference[-1] < reference[0]
    for padded in (128, 256):
        model = make_model(vocab=padded, unpadded_vocab_size=REAL_VOCAB)
        losses = _train(model)
        rel = ((losses - reference).abs() / reference).max()
        assert rel <= 1e-5, f"padded to {padded}: {losses.tolist()} vs {reference.tolist()}"
        for name in VOCAB_ROWS:
            assert torch.all(model.get_parameter(name)[REAL_VOCAB:] == 0), name


def test_unpadded_vocab_size_is_validated():
    for bad in (129, 1):
        with pytest.raises(ValueError, match="unpadded_vocab_size"):
            make_model(vocab=128, unpadded_vocab_size=bad)
    unpadded = make_model(vocab=REAL_VOCAB, unpadded_vocab_size=REAL_VOCAB)  # no padding at all
    ids, pos, _ = batch(REAL_VOCAB)
    torch.testing.assert_close(unpadded(ids, pos), make_model(vocab=REAL_VOCAB)(ids, pos))


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
