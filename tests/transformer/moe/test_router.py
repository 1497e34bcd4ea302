"""TopKRouter options on a 4-token, 4-expert case whose expected numbers come from the formulas.

The router's weight is the identity, so its logits are the input rows written below.
"""

import math

import pytest
import torch

from teratron.tensor_parallel import get_cuda_rng_tracker
from teratron.transformer.moe.moe_logging import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from teratron.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from teratron.transformer.moe.router import TopKRouter, update_moe_routers
from teratron.transformer.transformer_config import TransformerConfig

LOGITS = [[1.0, 2.0, 3.0, 0.0],
          [0.5, 0.0, -1.0, 2.0],
          [3.0, 1.0, 0.0, 2.5],
          [0.0, 0.2, 0.1, -0.3]]


def make_router(**overrides):
    kwargs = dict(num_layers=1, hidden_size=4, num_attention_heads=1, num_moe_experts=4,
                  moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True)
    kwargs.update(overrides)
    router = TopKRouter(TransformerConfig(**kwargs))
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    router.set_layer_number(1)
    return router


def route(router, logits=LOGITS, batch=1):
    """logits [T, E] as [T/batch, batch, E] input (token t = s * batch + b)."""
    x = torch.tensor(logits, dtype=torch.float32)
    return router(x.view(-1, batch, 4))


def softmax(values):
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def dense(rows):
    """{token: {expert: prob}} -> [T, E] tensor."""
    out = torch.zeros(4, 4)
    for t, row in rows.items():
        for e, p in row.items():
            out[t, e] = p
    return out


def check(probs, routing_map, expected):
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(routing_map, expected != 0)


def test_softmax_after_topk():
    probs, routing_map = route(make_router())
    a, b, c, d = (softmax([3.0, 2.0]), softmax([2.0, 0.5]), softmax([3.0, 2.5]), softmax([0.2, 0.1]))
    check(probs, routing_map, dense({0: {2: a[0], 1: a[1]}, 1: {3: b[0], 0: b[1]},
                                     2: {0: c[0], 3: c[1]}, 3: {1: d[0], 2: d[1]}}))


def test_pre_softmax_and_scaling_factor():
    probs, routing_map = route(make_router(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5))
    rows = [softmax(r) for r in LOGITS]
    expected = {0: {2: rows[0][2], 1: rows[0][1]}, 1: {3: rows[1][3], 0: rows[1][0]},
                2: {0: rows[2][0], 3: rows[2][3]}, 3: {1: rows[3][1], 2: rows[3][2]}}
    check(probs, routing_map, dense({t: {e: 2.5 * p for e, p in r.items()} for t, r in expected.items()}))


def test_topk1_pre_softmax():
    probs, routing_map = route(make_router(moe_router_topk=1, moe_router_pre_softmax=True))
    rows = [softmax(r) for r in LOGITS]
    check(probs, routing_map, dense({0: {2: rows[0][2]}, 1: {3: rows[1][3]}, 2: {0: rows[2][0]}, 3: {1: rows[3][1]}}))


def test_router_bias_with_add_bias_linear_shifts_the_logits():
    """Megatron's router bias (gpt-oss): logits x W^T + b, then top-2 softmax; none without biases."""
    assert make_router().bias is None
    router = make_router(add_bias_linear=True)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([2.0, 0.0, 0.0, -3.0]))
    probs, routing_map = route(router)
    # biased logits: [3, 2, 3, -3], [2.5, 0, -1, -1], [5, 1, 0, -.5], [2, .2, .1, -3.3]
    a, b, c, d = (softmax([3.0, 3.0]), softmax([2.5, 0.0]), softmax([5.0, 1.0]), softmax([2.0, 0.2]))
    check(probs, routing_map, dense({0: {0: a[0], 2: a[1]}, 1: {0: b[0], 1: b[1]},
                                     2: {0: c[0], 1: c[1]}, 3: {0: d[0], 1: d[1]}}))


def _sigmoid_normalised(t, experts):
    s = [sigmoid(LOGITS[t][e]) for e in experts]
    return {e: v / sum(s) for e, v in zip(experts, s)}


def test_sigmoid_scores():
    probs, routing_map = route(make_router(moe_router_score_function="sigmoid"))
    check(probs, routing_map, dense({0: _sigmoid_normalised(0, [2, 1]), 1: _sigmoid_normalised(1, [3, 0]),
                                     2: _sigmoid_normalised(2, [0, 3]), 3: _sigmoid_normalised(3, [1, 2])}))


def test_expert_bias_changes_choice_not_weights():
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, -1.0, 0.0]))  # expert 2 made unattractive
    probs, routing_map = route(router)
    # token 0: sigmoid+bias = [.73, .88, .95-1, .5] -> experts 1, 0; token 3: [.5, .55, .52-1, .43] -> 1, 0
    check(probs, routing_map, dense({0: _sigmoid_normalised(0, [1, 0]), 1: _sigmoid_normalised(1, [3, 0]),
                                     2: _sigmoid_normalised(2, [0, 3]), 3: _sigmoid_normalised(3, [1, 0])}))


def test_group_limited_routing():
    # Groups {0, 1} and {2, 3}; one group per token, scored by the sum of its best 2 logits;
    # then the top 2 inside it. Token 0 ties (3 vs 3) and is left out. Plain top-2 would pick
    # {3, 0}, {0, 3}, {1, 2} for tokens 1-3.
    probs, routing_map = route(make_router(moe_router_num_groups=2, moe_router_group_topk=1))
    groups = {1: [3, 2],   # group sums 0.5 vs 1.0
              2: [0, 1],   # 4.0 vs 2.5
              3: [1, 0]}   # 0.2 vs -0.2
    for t, experts in groups.items():
        p = softmax([LOGITS[t][e] for e in experts])
        expected = torch.zeros(4)
        expected[experts] = torch.tensor(p)
        torch.testing.assert_close(probs[t], expected)
        assert torch.equal(routing_map[t], expected != 0)


CAPACITY_LOGITS = [[2.0, 0.0, 0.0, 0.0],
                   [3.0, 0.0, 0.0, 0.0],
                   [1.0, 0.0, 0.0, 0.0],
                   [0.0, 0.0, 0.0, 1.0]]


def test_capacity_drop_policies_and_padding():
    # k=1, capacity = ceil(4 * 1 / 4 * 1.0) = 1 token per expert; tokens 0-2 all want expert 0.
    p = [softmax(r)[e] for r, e in zip(CAPACITY_LOGITS, [0, 0, 0, 3])]
    base = dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_expert_capacity_factor=1.0,
                moe_router_load_balancing_type="none")
    probs, routing_map = route(make_router(**base), CAPACITY_LOGITS)
    check(probs, routing_map, dense({1: {0: p[1]}, 3: {3: p[3]}}))  # highest probability kept
    probs, routing_map = route(make_router(moe_token_drop_policy="position", **base), CAPACITY_LOGITS)
    check(probs, routing_map, dense({0: {0: p[0]}, 3: {3: p[3]}}))  # earliest kept
    probs, routing_map = route(make_router(moe_pad_expert_input_to_capacity=True, **base), CAPACITY_LOGITS)
    assert routing_map.sum(dim=0).tolist() == [1, 1, 1, 1]  # every expert padded to its capacity
    assert routing_map[1, 0] and routing_map[3, 3]
    torch.testing.assert_close(probs, dense({1: {0: p[1]}, 3: {3: p[3]}}))  # padding weighs 0


def test_sinkhorn_balances_training_choice():
    # Every token prefers expert 0; Sinkhorn's balanced assignment is the diagonal.
    logits = [[3.0 + 2.0 * (e == t) if e == 0 else 2.0 * (e == t) for e in range(4)] for t in range(4)]
    router = make_router(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn")
    probs, routing_map = route(router, logits)
    check(probs, routing_map, dense({t: {t: sigmoid(logits[t][t])} for t in range(4)}))
    router.eval()
    probs, routing_map = route(router, logits)
    check(probs, routing_map, dense({t: {0: sigmoid(logits[t][0])} for t in range(4)}))


def test_router_dtype_fp64():
    probs, _ = route(make_router(moe_router_dtype="fp64"))
    assert probs.dtype == torch.float64


def _aux_grad(router, logits, batch=1):
    """Forward, then backward a zero main loss: the router weight's grad is the aux losses' alone."""
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    clear_aux_losses_tracker()
    router.weight.grad = None
    probs, _ = route(router, logits, batch)
    (probs.sum() * 0).backward()
    return router.weight.grad.clone()


def _reference_grad(loss_fn, logits):
    w = torch.eye(4, requires_grad=True)
    loss = loss_fn(torch.tensor(logits) @ w.t())
    loss.backward()
    return loss.detach(), w.grad


def _switch_loss(scores, topk, coeff):
    """coeff * E * sum_e mean_t(scores[t, e]) * count_e / (T * k), counts from the plain top-k."""
    tokens, experts = scores.shape
    counts = torch.zeros(experts)
    for row in scores.detach():
        for e in row.topk(topk).indices.tolist():
            counts[e] += 1
    return coeff * experts * sum(scores[:, e].mean() * counts[e] / (tokens * topk) for e in range(experts))


def test_aux_loss_value_and_gradient():
    router = make_router(moe_aux_loss_coeff=0.1)
    grad = _aux_grad(router, LOGITS)
    loss, expected_grad = _reference_grad(lambda z: _switch_loss(z.softmax(-1), 2, 0.1), LOGITS)
    torch.testing.assert_close(get_moe_layer_wise_logging_tracker()["load_balancing_loss"][0], loss / 0.1)
    torch.testing.assert_close(grad, expected_grad)


def test_aux_loss_gradient_follows_loss_scale():
    router = make_router(moe_aux_loss_coeff=0.1)
    base = _aux_grad(router, LOGITS)
    MoEAuxLossAutoScaler.set_loss_scale(0.25)  # e.g. 1 / num_microbatches
    router.weight.grad = None
    probs, _ = route(router)
    (probs.sum() * 0).backward()
    torch.testing.assert_close(router.weight.grad, base * 0.25)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)


def test_seq_aux_loss_is_mean_of_per_sequence_losses():
    # batch 2: sequence b holds tokens b and 2 + b (token index = s * batch + b).
    router = make_router(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1)
    grad = _aux_grad(router, LOGITS, batch=2)

    def loss_fn(z):
        return sum(_switch_loss(z[[b, 2 + b]].softmax(-1), 2, 0.1) for b in range(2)) / 2
    loss, expected_grad = _reference_grad(loss_fn, LOGITS)
    torch.testing.assert_close(get_moe_layer_wise_logging_tracker()["seq_load_balancing_loss"][0], loss / 0.1)
    torch.testing.assert_close(grad, expected_grad)


def test_global_aux_loss_averages_counts_over_microbatches():
    router = make_router(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
                         moe_aux_loss_coeff=[0.0, 0.1])
    second = [row[::-1] for row in LOGITS]
    _aux_grad(router, LOGITS)
    grad = _aux_grad(router, second)

    def counts(logits):
        return torch.zeros(4).index_add_(0, torch.tensor(logits).topk(2).indices.flatten(), torch.ones(8))
    average = (counts(LOGITS) + counts(second)) / 2

    def loss_fn(z):
        return 0.1 * 4 * (z.softmax(-1).mean(0) * average / (4 * 2)).sum()
    loss, expected_grad = _reference_grad(loss_fn, second)
    torch.testing.assert_close(get_moe_layer_wise_logging_tracker()["global_load_balancing_loss"][0], loss / 0.1)
    torch.testing.assert_close(grad, expected_grad)
    update_moe_routers(router)  # a new step starts counting afresh
    assert router.ga_steps.item() == 0 and router.global_tokens_per_expert.sum().item() == 0


def test_z_loss_value_and_gradient():
    router = make_router(moe_z_loss_coeff=0.01)
    grad = _aux_grad(router, LOGITS)
    loss, expected_grad = _reference_grad(
        lambda z: 0.01 * sum(torch.log(torch.exp(row).sum()) ** 2 for row in z) / 4, LOGITS)
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS) / 4
    torch.testing.assert_close(get_moe_layer_wise_logging_tracker()["z_loss"][0], torch.tensor(expected))
    torch.testing.assert_close(loss, torch.tensor(0.01 * expected))
    torch.testing.assert_close(grad, expected_grad)


def test_input_jitter_only_while_training():
    router = make_router(moe_input_jitter_eps=0.1)
    x = torch.tensor(LOGITS).view(4, 1, 4)
    jittered = router.apply_input_jitter(x)
    ratio = jittered / x.masked_fill(x == 0, 1.0)
    assert not torch.equal(jittered, x) and ((ratio - 1).abs() <= 0.1 + 1e-6)[x != 0].all()
    router.eval()
    assert torch.equal(router.apply_input_jitter(x), x)


def test_force_load_balancing_uses_random_logits_with_straight_through_grad():
    router = make_router(moe_router_force_load_balancing=True, moe_router_load_balancing_type="none")
    get_cuda_rng_tracker().reset()  # an earlier test may have seeded the expert stream in this process
    torch.manual_seed(0)
    probs, _ = route(router)
    torch.manual_seed(0)
    expected = torch.randn(4, 4).topk(2).indices.sort().values
    assert torch.equal(probs.nonzero()[:, 1].view(4, 2), expected)
    probs.sum().backward()
    assert router.weight.grad is not None


def test_expert_bias_update_moves_towards_balance():
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_bias_update_rate=0.5)
    skewed = [[4.0, 3.0, 0.0, 0.0]] * 4  # every token takes experts 0 and 1
    route(router, skewed)
    assert router.local_tokens_per_expert.tolist() == [4, 4, 0, 0]
    update_moe_routers(router)
    assert router.expert_bias.tolist() == [-0.5, -0.5, 0.5, 0.5]
    assert router.local_tokens_per_expert.sum().item() == 0

    torch.manual_seed(0)
    logits = (torch.randn(16, 4) + torch.tensor([2.0, 1.5, 0.0, 0.0])).view(16, 1, 4)
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_bias_update_rate=0.05)
    loads = []
    for _ in range(30):
        loads.append(router(logits)[1].sum(0).max().item())
        update_moe_routers(router)
    assert loads[0] == 15 and max(loads[-5:]) <= 10  # 32 slots: 8 per expert when balanced


def test_quantile_balancing_estimate_and_update():
    router = make_router(moe_router_load_balancing_type="quantile_balancing", moe_router_score_function="sigmoid")
    logits = [[2.0, 1.0, 0.0, -1.0]] * 4  # all tokens rank the experts alike
    probs, routing_map = route(router, logits)
    assert routing_map.sum(0).tolist() == [4, 4, 0, 0]
    # beta = 0: each token's cutoff is its 3rd score s2; expert e's estimate is the 3rd largest
    # (q + 1 with q = 4 * 2 / 4 = 2) of s_e - s2 over tokens: s_e - s2 (all tokens equal).
    s = [sigmoid(v) for v in logits[0]]
    torch.testing.assert_close(router.qb_beta_accum, torch.tensor([x - s[2] for x in s]))
    update_moe_routers(router)
    estimate = torch.tensor([x - s[2] for x in s])
    torch.testing.assert_close(router.qb_beta, estimate - estimate.mean())
    # A skewed batch of distinct tokens is balanced by one update from its own estimate.
    router.qb_beta.zero_()
    torch.manual_seed(0)
    skewed = (torch.randn(16, 4) + torch.tensor([2.0, 1.5, 0.0, 0.0])).view(16, 1, 4)
    assert router(skewed)[1].sum(0).tolist() == [15, 12, 2, 3]
    update_moe_routers(router)
    assert all(abs(n - 8) <= 1 for n in router(skewed)[1].sum(0).tolist())


def test_routing_state_stays_fp32_under_bf16():
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True).bfloat16()
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == router.local_tokens_per_expert.dtype == torch.float32


def test_bad_options_raise():
    with pytest.raises(ValueError, match="moe_router_group_topk"):
        make_router(moe_router_topk=1, moe_router_pre_softmax=True, moe_router_num_groups=2,
                    moe_router_group_topk=2)
    with pytest.raises(ValueError, match="moe_aux_loss_coeff"):
        make_router(moe_router_load_balancing_type=["sinkhorn", "aux_loss"], moe_aux_loss_coeff=[0.0, 0.1])
