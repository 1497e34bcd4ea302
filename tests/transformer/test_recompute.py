"""Activation recompute (full uniform / block, selective core_attn / mlp / layernorm) gives the
same loss and gradients as keeping every activation, dropout included (RNG states replayed)."""

import pytest
import torch

from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel import model_parallel_cuda_manual_seed
from teratron.transformer.transformer_config import TransformerConfig

SEQ, BATCH, VOCAB = 16, 2, 64

RECOMPUTE = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective-core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective-mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "selective-layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "selective-all": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]),
}


def run(backend, dropout_seed=3, num_experts=None, **recompute):
    """Loss, grads and MLP-forward count of one training step of a 3-layer GPT with dropout."""
    moe = dict(num_moe_experts=num_experts, moe_router_topk=2, moe_ffn_hidden_size=32) if num_experts else {}
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, hidden_dropout=0.2, attention_dropout=0.2,
                               attention_backend=backend, use_cpu_initialization=True, **moe, **recompute)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts), VOCAB, SEQ, position_embedding_type="rope",
                     pg_collection=ProcessGroupCollection())
    calls = []
    for layer in model.decoder.layers:
        layer.mlp.register_forward_hook(lambda *_: calls.append(1))
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g)
    model_parallel_cuda_manual_seed(dropout_seed, tp_rank=0, ep_rank=0, etp_rank=0)
    loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(calls)


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_recompute_matches_no_recompute_with_dropout(backend):
    loss, grads, calls = run(backend)
    assert calls == 3
    assert not torch.equal(run(backend, dropout_seed=4)[0], loss)  # dropout is live
    for name, recompute in RECOMPUTE.items():
        r_loss, r_grads, r_calls = run(backend, **recompute)
        torch.testing.assert_close(r_loss, loss, rtol=1e-6, atol=0, msg=f"{name} loss")
        for param, grad in grads.items():
            torch.testing.assert_close(r_grads[param], grad, rtol=1e-5, atol=1e-7, msg=f"{name} {param} grad")
        recomputed_mlps = {"full-uniform-1": 3, "full-uniform-2": 3, "full-block-2": 2,
                           "selective-mlp": 3, "selective-all": 3}.get(name, 0)
        assert r_calls == 3 + recomputed_mlps, f"{name}: {r_calls} MLP forwards"


def test_selective_recompute_of_moe_layers():
    from teratron.transformer.moe import clear_aux_losses_tracker

    clear_aux_losses_tracker()  # the routers log into a process-wide tracker sized by num_layers
    loss, grads, calls = run("auto", num_experts=4)
    for modules, recomputed in ((["moe"], 3), (["mlp"], 0)):  # 'mlp' names the dense MLP only
        r_loss, r_grads, r_calls = run("auto", num_experts=4, recompute_granularity="selective",
                                       recompute_modules=modules)
        torch.testing.assert_close(r_loss, loss, rtol=1e-6, atol=0)
        for param, grad in grads.items():
            torch.testing.assert_close(r_grads[param], grad, rtol=1e-5, atol=1e-7, msg=f"{modules} {param}")
        assert r_calls == calls + recomputed
    clear_aux_losses_tracker()
