"""The training step's MoE hooks on one process: the aux losses' gradient scale under gradient
accumulation and the fp16 loss scale, the router update and the step's metrics."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from teratron.models.gpt import GPTModel, get_gpt_decoder_block_spec
from teratron.pipeline_parallel.schedules import forward_backward_no_pipelining
from teratron.training.gpt_step import forward_step
from teratron.training.moe_step import finish_moe_step, moe_aux_loss_scale, set_moe_aux_loss_scale
from teratron.transformer.moe import MoEAuxLossAutoScaler, TopKRouter
from teratron.transformer.moe.moe_logging import get_moe_layer_wise_logging_tracker
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH = 64, 8, 2


def _model(**moe):
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4,
        moe_ffn_hidden_size=16, moe_router_topk=2, moe_layer_freq=[1, 0], gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, init_method_std=0.2, hidden_dropout=0.0,
        attention_dropout=0.0, normalization="RMSNorm", use_cpu_initialization=True, **moe)
    torch.manual_seed(5)
    spec = get_gpt_decoder_block_spec(config)
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope")


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
            "loss_mask": torch.ones(BATCH, SEQ)}


def _step_grads(model, num_microbatches, scale=None):
    """Grads of one step over `num_microbatches` copies of the same micro-batch."""
    model.zero_grad()
    if scale is None:
        set_moe_aux_loss_scale(model.config, num_microbatches, torch.device("cpu"))
    else:
        MoEAuxLossAutoScaler.set_loss_scale(scale)
    forward_backward_no_pipelining(
        forward_step_func=lambda it, m: forward_step(it, m, torch.device("cpu")),
        data_iterator=itertools.repeat(_batch()), model=model, num_microbatches=num_microbatches,
        seq_length=SEQ, micro_batch_size=BATCH)
    finish_moe_step([model], model.config, num_microbatches)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_aux_loss_scale_formula():
    class Config:
        grad_scale_func = None
        calculate_per_token_loss = False

    config = Config()
    assert moe_aux_loss_scale(config, 4, "cpu").item() == 0.25
    config.grad_scale_func = lambda loss: loss * 1024.0  # the fp16 loss scale
    assert moe_aux_loss_scale(config, 4, "cpu").item() == 256.0
    config.calculate_per_token_loss = True  # the schedule does not divide by the micro-batches
    assert moe_aux_loss_scale(config, 4, "cpu").item() == 1024.0


def test_aux_losses_accumulate_like_the_main_loss():
    """N identical micro-batches average to one: the same grads as a single micro-batch (whose
    aux-loss scale is 1 by any definition), also for the router, which only the aux and z
    losses reach differently; a loss scale multiplies every grad, aux-driven ones included."""
    model = _model(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    name = next(n for n, p in model.named_parameters() if p is router.weight)
    one = _step_grads(model, 1)
    three = _step_grads(model, 3)
    for key in one:
        torch.testing.assert_close(three[key], one[key], rtol=1e-5, atol=1e-7)
    # Unscaled aux losses (the bug this guards against) would count three times.
    unscaled = _step_grads(model, 3, scale=1.0)
    assert not torch.allclose(unscaled[name], one[name], rtol=1e-3)

    model.config.grad_scale_func = lambda loss: loss * 8.0
    try:
        scaled = _step_grads(model, 3)
    finally:
        model.config.grad_scale_func = None
    for key in one:
        torch.testing.assert_close(scaled[key], 8.0 * one[key], rtol=1e-5, atol=1e-6)


def test_finish_moe_step_updates_the_expert_bias_and_returns_the_metrics():
    model = _model(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_bias_update_rate=0.125, moe_router_load_balancing_type="seq_aux_loss",
                   moe_aux_loss_coeff=0.01, moe_per_layer_logging=True)
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    set_moe_aux_loss_scale(model.config, 2, torch.device("cpu"))
    for seed in range(2):
        b = _batch(seed)
        model(b["tokens"], b["position_ids"], labels=b["labels"]).mean().backward()
    counts = get_moe_layer_wise_logging_tracker()["tokens_per_expert"][0].clone()
    assert counts.sum().item() == 2 * BATCH * SEQ * 2  # two micro-batches, top-2
    seq_loss = get_moe_layer_wise_logging_tracker()["seq_load_balancing_loss"][0].item() / 2

    metrics = finish_moe_step([model], model.config, num_microbatches=2)
    expected_bias = 0.125 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(router.expert_bias, expected_bias)
    assert router.local_tokens_per_expert.abs().sum() == 0
    assert metrics["tokens_per_expert_layer_1"] == counts.tolist()
    assert metrics["seq_load_balancing_loss"] == pytest.approx(seq_loss)
    assert metrics["seq_load_balancing_loss_layer_1"] == pytest.approx(seq_loss)
    assert metrics["moe_load_imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
    assert not get_moe_layer_wise_logging_tracker()  # emptied for the next step


def test_dense_model_has_no_moe_step():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)
    MoEAuxLossAutoScaler.set_loss_scale(None)
    set_moe_aux_loss_scale(config, 4, torch.device("cpu"))
    assert MoEAuxLossAutoScaler.main_loss_backward_scale is None
    assert finish_moe_step([torch.nn.Linear(2, 2)], config, 4) == {}
