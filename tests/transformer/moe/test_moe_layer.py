"""MoELayer in one process: the math written out, grouped GEMM = loop, dropless = capacity,
router replay, the metrics tracker."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from teratron.tensor_parallel.random import checkpoint
from teratron.transformer.init_rng import component_rng
from teratron.transformer.moe import (MoEAuxLossAutoScaler, RouterReplayAction, clear_router_replay,
                                      get_moe_module_spec, load_router_replay, save_router_replay, set_replay_routing,
                                      set_router_replay_action, track_moe_metrics)
from teratron.transformer.moe.moe_logging import (clear_aux_losses_tracker, moe_layer_indices, num_tracked_layers,
                                                  save_to_aux_losses_tracker)
from teratron.transformer.moe.router_replay import get_recorded_routing
from teratron.transformer.spec_utils import build_module
from teratron.transformer.transformer_config import TransformerConfig

S, B, H = 8, 2, 16


def make_config(**overrides):
    kwargs = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=4,
                  moe_ffn_hidden_size=12, moe_router_topk=2, init_method_std=0.3,
                  hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build(config, grouped=False, seed=7):
    torch.manual_seed(seed)
    with component_rng("layer1"):
        return build_module(get_moe_module_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped),
                            config=config, layer_number=1)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def run(layer, x, grad):
    x = x.clone().requires_grad_()
    y, bias = layer(x)
    assert bias is None
    y.backward(grad)
    return y.detach(), x.grad


def expert_weights(layer, e):
    """(fc1 [fc1, h], fc1 bias, fc2 [h, ffn], fc2 bias) of expert e, either expert class."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):
        mlp = experts.local_experts[e]
        return mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias
    b1 = None if experts.bias1 is None else experts.bias1[e]
    b2 = None if experts.bias2 is None else experts.bias2[e]
    return experts.weight1[e].t(), b1, experts.weight2[e].t(), b2


def router_logits(layer, tokens):
    """tokens [T, h] -> [T, E]: x W^T plus the router's bias (add_bias_linear, as in Megatron)."""
    bias = layer.router.bias
    return tokens @ layer.router.weight.t() + (0 if bias is None else bias)


def reference(layer, x, config):
    """y[t] = sum over the top-k experts e of p_e(t) * fc2(act(fc1(x[t]))), token by token."""
    tokens = x.reshape(-1, H)
    logits = router_logits(layer, tokens)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        top = logits[t].topk(config.moe_router_topk)
        probs = top.values.softmax(-1)
        for p, e in zip(probs, top.indices.tolist()):
            w1, b1, w2, b2 = expert_weights(layer, e)
            h = tokens[t] @ w1.t() + (0 if b1 is None else b1)
            if config.gated_linear_unit:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            out[t] += p * (h @ w2.t() + (0 if b2 is None else b2))
    if layer.shared_experts is not None:
        mlp = layer.shared_experts
        h = tokens @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias
        shared = F.gelu(h) @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias
        if config.moe_shared_expert_gate:  # one scalar per token: sigmoid(x . w_gate)
            shared = shared * torch.sigmoid(tokens @ mlp.gate_weight[0])[:, None]
        out = out + shared
    return out.view_as(x)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_layer_equals_written_out_math(grouped, swiglu):
    config = make_config(gated_linear_unit=swiglu, activation_func=F.silu if swiglu else None,
                         add_bias_linear=not swiglu,
                         moe_shared_expert_intermediate_size=None if swiglu else 8)
    layer = build(config, grouped)
    with torch.no_grad():  # biases start at zero: give them values so they count
        for name, p in layer.named_parameters():
            if "bias" in name:
                p.normal_()
    x, _ = inputs()
    torch.testing.assert_close(layer(x)[0], reference(layer, x, config))


def test_gated_shared_expert_equals_its_formula():
    """y = routed(x) + sigmoid(x . w_gate) * shared(x): outputs and every gradient (the gate's
    included) as autograd gives them through the formula written out; the gate is no no-op."""
    config = make_config(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
    layer = build(config)
    gate = layer.shared_experts.gate_weight
    assert gate.shape == (1, H) and gate.sequence_parallel is False
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "bias" in name:
                p.normal_()
    x, grad = inputs()
    y, dx = run(layer, x, grad)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    x_ref = x.clone().requires_grad_()
    expected = reference(layer, x_ref, config)
    expected.backward(grad)
    torch.testing.assert_close(y, expected.detach())
    torch.testing.assert_close(dx, x_ref.grad)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")
    scores = torch.sigmoid(x.reshape(-1, H) @ gate[0].detach())
    assert scores.min() < 0.2 and scores.max() > 0.8
    with pytest.raises(ValueError, match="moe_shared_expert_gate gates the shared experts; set "
                                         "moe_shared_expert_intermediate_size"):
        make_config(moe_shared_expert_gate=True)


@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_equals_loop(swiglu):
    config = make_config(gated_linear_unit=swiglu, activation_func=F.silu if swiglu else None,
                         add_bias_linear=not swiglu, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    loop, grouped = build(config, grouped=False), build(config, grouped=True)
    x, grad = inputs()
    y_loop, dx_loop = run(loop, x, grad)
    y_grouped, dx_grouped = run(grouped, x, grad)
    torch.testing.assert_close(y_grouped, y_loop)
    torch.testing.assert_close(dx_grouped, dx_loop)
    torch.testing.assert_close(grouped.router.weight.grad, loop.router.weight.grad)
    for e in range(4):
        mlp = loop.experts.local_experts[e]
        torch.testing.assert_close(grouped.experts.weight1.grad[e].t(), mlp.linear_fc1.weight.grad)
        torch.testing.assert_close(grouped.experts.weight2.grad[e].t(), mlp.linear_fc2.weight.grad)
        if config.add_bias_linear:
            torch.testing.assert_close(grouped.experts.bias1.grad[e], mlp.linear_fc1.bias.grad)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_dropless_equals_ample_capacity(pad, policy):
    x, grad = inputs()
    y, dx = run(build(make_config()), x, grad)
    # capacity = ceil(T * k / E * 2.0) = T: no expert can overflow.
    capped = build(make_config(moe_expert_capacity_factor=2.0, moe_token_drop_policy=policy,
                               moe_pad_expert_input_to_capacity=pad))
    y_capped, dx_capped = run(capped, x, grad)
    torch.testing.assert_close(y_capped, y)
    torch.testing.assert_close(dx_capped, dx)


def test_tight_capacity_drops_tokens():
    x, _ = inputs()
    layer = build(make_config(moe_expert_capacity_factor=0.5))
    probs, routing_map = layer.router(x)
    assert routing_map.sum(0).max().item() <= 4  # ceil(16 * 2 / 4 * 0.5)
    assert routing_map.sum().item() < 32


def test_apply_probs_on_input():
    config = make_config(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True,
                         add_bias_linear=False)
    layer = build(config)
    x, _ = inputs()
    tokens = x.reshape(-1, H)
    probs = (tokens @ layer.router.weight.t()).softmax(-1)
    p, e = probs.max(-1)
    expected = torch.stack([
        F.gelu((p[t] * tokens[t]) @ expert_weights(layer, e[t])[0].t()) @ expert_weights(layer, e[t])[2].t()
        for t in range(tokens.shape[0])])
    torch.testing.assert_close(layer(x)[0], expected.view_as(x))
    with pytest.raises(ValueError, match="moe_apply_probs_on_input"):
        build(make_config(moe_apply_probs_on_input=True))


def test_router_replay_reproduces_recorded_routing(tmp_path):
    layer = build(make_config(moe_router_load_balancing_type="none"))
    batches = [inputs(seed)[0] for seed in range(3)]
    set_router_replay_action(layer, RouterReplayAction.RECORD)
    recorded_maps = [layer.router(x)[1] for x in batches]
    save_router_replay(tmp_path / "routing.safetensors", layer)
    recorded = get_recorded_routing(layer)
    assert list(recorded) == [1] and len(recorded[1]) == 3 and recorded[1][0].shape == (S * B, 2)

    with torch.no_grad():
        layer.router.weight.normal_()  # a different router would route differently ...
    assert not all(torch.equal(layer.router(x)[1], m) for x, m in zip(batches, recorded_maps))
    set_replay_routing(layer, load_router_replay(tmp_path / "routing.safetensors"))
    set_router_replay_action(layer, RouterReplayAction.REPLAY)
    for x, expected in zip(batches, recorded_maps):  # ... but replays the recording exactly
        probs, routing_map = layer.router(x)
        assert torch.equal(routing_map, expected)
        logits = router_logits(layer, x.reshape(-1, H))
        weights = logits.gather(1, recorded[1].pop(0)).softmax(-1)  # weights from today's logits
        torch.testing.assert_close(probs[routing_map].view(-1, 2).sort(-1).values, weights.sort(-1).values)
    with pytest.raises(RuntimeError, match="ran out"):
        layer.router(batches[0])
    clear_router_replay(layer)
    assert get_recorded_routing(layer) == {1: []}

    save_file({"layer1.call0": torch.zeros(2, 2, dtype=torch.int32)}, str(tmp_path / "renamed.safetensors"),
              metadata={"format": "teratron.router_replay", "version": "1"})
    with pytest.raises(ValueError, match="renamed.safetensors: tensor 'layer1.call0' is not named"):
        load_router_replay(tmp_path / "renamed.safetensors")


def test_router_replay_under_activation_recompute():
    layer = build(make_config(moe_router_load_balancing_type="none"))
    x, grad = inputs()
    set_router_replay_action(layer, RouterReplayAction.RECORD)
    checkpoint(layer, False, x.clone().requires_grad_())[0].backward(grad)
    routing = get_recorded_routing(layer)[1]
    assert len(routing) == 1  # the recompute inside backward recorded nothing
    with torch.no_grad():
        layer.router.weight.normal_()
    set_router_replay_action(layer, None)
    assert not torch.equal(layer.router(x)[1].nonzero()[:, 1].view(-1, 2), routing[0].sort(-1).values)

    set_replay_routing(layer, {1: routing * 2})
    set_router_replay_action(layer, RouterReplayAction.REPLAY)
    layer.zero_grad()
    y, dx = run(layer, x, grad)
    router_grad = layer.router.weight.grad.clone()
    layer.zero_grad()
    x_ckpt = x.clone().requires_grad_()
    y_ckpt = checkpoint(layer, False, x_ckpt)[0]
    y_ckpt.backward(grad)  # the recompute must replay the same entry as its first pass
    torch.testing.assert_close(y_ckpt, y)
    torch.testing.assert_close(x_ckpt.grad, dx)
    torch.testing.assert_close(layer.router.weight.grad, router_grad)

    # An evaluation forward (no grad, nothing to recompute) replays its own entry and leaves none
    # behind for the next recompute.
    set_replay_routing(layer, {1: [(routing[0] + 1) % 4, routing[0]]})
    layer.eval()
    with torch.no_grad():
        assert not torch.equal(layer(x)[0], y)
    layer.train()
    layer.zero_grad()
    x_ckpt = x.clone().requires_grad_()
    checkpoint(layer, False, x_ckpt)[0].backward(grad)
    torch.testing.assert_close(x_ckpt.grad, dx)
    torch.testing.assert_close(layer.router.weight.grad, router_grad)


def test_metrics_tracker():
    clear_aux_losses_tracker()
    config = make_config(num_layers=2, moe_layer_freq=[0, 1], moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                         moe_per_layer_logging=True)
    torch.manual_seed(0)
    layer = build_module(get_moe_module_spec(num_experts=4), config=config, layer_number=2)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    losses, zs, counts = [], [], torch.zeros(4)
    for seed in range(2):  # two micro-batches
        x, grad = inputs(seed)
        run(layer, x, grad)
        logits = router_logits(layer, x.reshape(-1, H))
        scores, top = logits.softmax(-1), logits.topk(2).indices
        f = torch.zeros(4).index_add_(0, top.flatten(), torch.ones(top.numel()))
        counts += f
        losses.append(4 * (scores.mean(0) * f / (S * B * 2)).sum())
        zs.append(torch.logsumexp(logits, -1).square().mean())
    metrics = track_moe_metrics(0.5, config)
    assert metrics["load_balancing_loss"] == pytest.approx(sum(losses).item() / 2, rel=1e-5)
    assert metrics["load_balancing_loss_layer_2"] == metrics["load_balancing_loss"]
    assert "load_balancing_loss_layer_1" not in metrics  # layer 1 is dense
    assert metrics["z_loss"] == pytest.approx(sum(zs).item() / 2, rel=1e-5)
    assert metrics["tokens_per_expert_layer_2"] == counts.tolist()
    assert metrics["moe_load_imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
    assert track_moe_metrics(0.5, config)["load_balancing_loss"] == 0.0  # the tracker was cleared


def test_a_hybrid_models_tracker_rows_are_its_pattern_s_layers():
    """'M*E/ME/ME': the decoder's 3 layers, then each MTP depth's 2 (7 rows), MoE at layers 3, 5 and
    7; the losses are averaged over those three alone, and the depths' MoE layers have their rows."""
    config = make_config(num_layers=3, hybrid_layer_pattern="M*E/ME/ME", mtp_num_layers=2, moe_aux_loss_coeff=0.01)
    assert num_tracked_layers(config) == 7 and moe_layer_indices(config) == [2, 4, 6]
    clear_aux_losses_tracker()
    for layer_number, value in ((3, 1.0), (5, 2.0), (7, 6.0)):
        save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(value), layer_number, num_tracked_layers(config))
    assert track_moe_metrics(1.0, config)["load_balancing_loss"] == pytest.approx((1.0 + 2.0 + 6.0) / 3)


def test_unsupported_options_raise():
    with pytest.raises(NotImplementedError, match="moe_latent_size"):
        build(make_config(moe_latent_size=8))
    with pytest.raises(ValueError, match="moe_token_dropping"):
        build(make_config(moe_token_dropping=True))


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_compiled_layers_do_not_recompile_as_the_routing_changes(dispatcher):
    """`--torch-compile` compiles layers whole, one compiled code object shared by every layer.
    Nothing that changes between layers or steps may be traced: the tokens per expert (new every
    step), the layer number (one per layer) and the metrics tracker (read and cleared every
    step); each would recompile until Dynamo's limit and then run the layers eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    config = make_config(moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=1e-2, num_layers=3)
    layers = [build(config, grouped=True, seed=i) for i in range(3)]
    for number, layer in enumerate(layers, start=1):
        layer.set_layer_number(number)
        layer.compile(backend="eager")  # Dynamo's guards and recompiles; no code generation
    counts = set()
    for step in range(6):
        inputs = torch.randn(S, B, H, generator=torch.Generator().manual_seed(step)) * (step + 1)
        x = inputs.requires_grad_()
        for number, layer in enumerate(layers):
            # The first call compiles; every later layer and step must reuse it.
            with torch._dynamo.config.patch(error_on_recompile=step + number > 0):
                x = layer(x)[0]
        x.sum().backward()
        loss = track_moe_metrics(1.0, config)["load_balancing_loss"]  # reads and clears, as each step does
        assert loss > 0
        with torch.no_grad():
            counts.add(tuple(layers[0].router(inputs)[1].sum(dim=0).tolist()))  # this step's tokens per expert
    clear_aux_losses_tracker()
    assert len(counts) > 2  # the routing did change
