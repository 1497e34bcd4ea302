"""The sampler never returns a padded vocabulary id, and otherwise samples exactly softmax(z / T)
over the top-k real logits (checked against torch.multinomial drawn with the same generator).
"""

import pytest
import torch

from teratron.inference import generate, sample_next_token
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.transformer.transformer_config import TransformerConfig

REAL, PADDED = 100, 128


def _logits(seed=0):
    """Real logits, and padding logits far above them (an old checkpoint's trained padding rows)."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(REAL, generator=g) * 2, torch.full((PADDED - REAL,), 1e4)])


def _reference(real_logits, temperature, top_k, seed):
    z = real_logits / temperature
    if top_k is not None:
        keep = torch.topk(z, top_k).indices
        z = torch.full_like(z, float("-inf")).index_copy(0, keep, z[keep])
    return int(torch.multinomial(torch.softmax(z, -1), 1, generator=torch.Generator().manual_seed(seed)))


def test_padding_ids_are_never_sampled_and_real_ids_follow_softmax():
    logits = _logits()
    assert sample_next_token(logits, 0.0, None, vocab_size=REAL) == int(torch.argmax(logits[:REAL]))
    for temperature in (0.5, 1.0, 3.0):
        for top_k in (None, 1, 7, REAL, PADDED + 5):
            for seed in range(20):
                got = sample_next_token(logits, temperature, top_k, torch.Generator().manual_seed(seed),
                                        vocab_size=REAL)
                assert got < REAL
                k = None if top_k is None or top_k >= REAL else top_k
                assert got == _reference(logits[:REAL], temperature, k, seed)


def test_sampler_rejects_bad_arguments():
    logits = _logits()
    for kwargs, field in ((dict(temperature=-1.0, top_k=None), "temperature"),
                          (dict(temperature=1.0, top_k=0), "top_k"),
                          (dict(temperature=1.0, top_k=None, vocab_size=PADDED + 1), "vocab_size")):
        with pytest.raises(ValueError, match=field):
            sample_next_token(logits, **kwargs)


def _padded_model():
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(), PADDED, 16, position_embedding_type="rope",
                     unpadded_vocab_size=REAL)
    with torch.no_grad():  # padding rows that are not zero (e.g. from a checkpoint trained without the mask)
        model.output_layer.weight[REAL:] = torch.randn(PADDED - REAL, 32) * 100
    return model


def test_a_padded_model_never_yields_a_padding_id():
    model = _padded_model().eval()
    ids = torch.randint(0, REAL, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, None)[0]
    assert torch.all(logits[:, REAL:] == float("-inf"))
    for row in logits:  # without vocab_size: the model's -inf alone keeps padding out
        assert sample_next_token(row, 0.0, None) < REAL
        for seed in range(10):
            assert sample_next_token(row, 1.0, None, torch.Generator().manual_seed(seed)) < REAL
            assert sample_next_token(row, 1.0, PADDED, torch.Generator().manual_seed(seed)) < REAL


class _PaddingLovingModel(torch.nn.Module):
    """Returns [1, s, PADDED] logits whose padding columns dominate: a model built without
    unpadded_vocab_size. generate must still stay in the tokenizer's vocabulary."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, tokens, position_ids, attention_mask):
        return self.scale * _logits(int(tokens.sum())).expand(1, tokens.shape[1], PADDED)


def test_generate_stays_in_the_tokenizer_vocabulary():
    tokenizer = NullTokenizer(REAL)
    for model in (_padded_model(), _PaddingLovingModel()):
        text = generate(model, tokenizer, "3 14 15", max_new_tokens=12, max_sequence_length=16,
                        temperature=1.0, top_k=None, generator=torch.Generator().manual_seed(0))
        ids = [int(t) for t in text.split()]
        assert ids[:3] == [3, 14, 15] and all(0 <= i < REAL for i in ids)


def test_generate_rejects_an_empty_prompt_and_keeps_the_mode():
    model = _PaddingLovingModel().train()
    with pytest.raises(ValueError, match="no tokens"):
        generate(model, NullTokenizer(REAL), "", max_new_tokens=2, max_sequence_length=16)
    with pytest.raises(ValueError, match="temperature"):  # raised inside the loop
        generate(model, NullTokenizer(REAL), "3", max_new_tokens=2, max_sequence_length=16, temperature=-1.0)
    assert model.training
