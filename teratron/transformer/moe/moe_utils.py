"""Routing math of the MoE layer: scores, top-k selection, capacity, load-balancing losses and
token permutation. Nothing here communicates (the token dispatcher owns MoE collectives).

Shapes: T tokens (this rank's [s, b] positions flattened s-major), E experts, k = topk.
Names follow Megatron: `logits` come out of the gate, `scores` are after the score function,
`probs` weight the experts' outputs, `routing_map` [T, E] (bool) says which expert gets which token.
"""

import math

import torch


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; its backward also sends a gradient into `aux_loss`, so an auxiliary
    loss joins backward without changing any forward value.

    The gradient of the aux loss is `main_loss_backward_scale`: the factor the schedule applies to
    the main loss (1 / num_microbatches, times the loss scale under fp16), set per step with
    `set_loss_scale`, so aux and main losses are accumulated alike.
    """

    main_loss_backward_scale = None

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = 1.0
        elif torch.is_tensor(scale):
            scale = scale.to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale

    @staticmethod
    def set_loss_scale(scale):
        """Backward scale of every aux loss from now on (a float or a scalar tensor)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


def widen(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64): softmax and sigmoid of routing run there."""
    return x if x.dtype == torch.float64 else x.float()


# ----- load-balancing losses --------------------------------------------------------------------

def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens: int, topk: int,
                                    num_experts: int, moe_aux_loss_coeff: float):
    """Switch-Transformer aux loss  coeff * E * sum_e P_e * f_e  with
    P_e = sum_t probs[t, e] / T and f_e = tokens_per_expert[e] / (T * k).

    `probs` [T_local, E] are this rank's tokens while `tokens_per_expert` and `total_num_tokens` T
    count every rank sharing the batch, so the ranks' losses sum to the loss of the whole batch.
    """
    aggregated = probs.sum(dim=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(aggregated * tokens_per_expert) * scale


def z_loss_func(logits, z_loss_coeff: float):
    """ST-MoE router z-loss: coeff * mean_t logsumexp(logits[t])^2."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Balance exp(cost) [T, E] towards equal row and column sums (Sinkhorn-Knopp)."""
    cost = torch.exp(cost)
    row = torch.ones(cost.shape[0], device=cost.device, dtype=cost.dtype)
    col = torch.ones(cost.shape[1], device=cost.device, dtype=cost.dtype)
    eps, error, col_old = 1e-8, float("inf"), col
    while error > tol:
        row = 1.0 / (row.numel() * (cost @ col + eps))
        col = 1.0 / (col.numel() * (row @ cost + eps))
        error = torch.mean(torch.abs(col_old - col)).item()
        col_old = col
    return col * cost * row.unsqueeze(1)


# ----- top-k selection --------------------------------------------------------------------------

def group_limited_topk(scores, topk: int, num_groups: int, group_topk: int):
    """Top-k restricted to `group_topk` of `num_groups` contiguous expert groups per token; a
    group's score is the sum of its best topk // group_topk experts (DeepSeek-V2/V3).
    Returns (values [T, k], indices [T, k])."""
    num_tokens, num_experts = scores.shape
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1).values.sum(-1)
    groups = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // num_groups).reshape(num_tokens, -1)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def _topk(scores, topk, num_groups=None, group_topk=None):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, k=topk, dim=-1)


def _scatter_topk(logits, top_indices, probs):
    """[T, k] indices and probs -> dense routing_probs [T, E] and routing_map [T, E] (bool)."""
    routing_probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def topk_routing_with_score_function(logits, topk: int, use_pre_softmax: bool = False,
                                     num_groups=None, group_topk=None, scaling_factor=None,
                                     score_function: str = "softmax", expert_bias=None,
                                     top_indices=None):
    """Select k experts per token and weight them (Megatron's routing semantics).

    softmax: softmax over all experts then top-k (pre_softmax), or top-k logits then softmax
    over those k. sigmoid: top-k of sigmoid(logits) (+ expert_bias for the choice only), weights
    renormalised to sum 1 when k > 1. `top_indices` [T, k], when given, replaces the choice
    (router replay); the weights still come from the current logits.
    Returns routing_probs [T, E], routing_map [T, E] (bool) and top_indices [T, k].
    """
    def select(selection_scores):
        if top_indices is not None:
            return top_indices
        return _topk(selection_scores, topk, num_groups, group_topk).indices

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(widen(logits), dim=-1).type_as(logits)
            top_indices = select(scores)
            probs = scores.gather(1, top_indices)
        else:
            top_indices = select(logits)
            probs = torch.softmax(widen(logits.gather(1, top_indices)), dim=-1).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(widen(logits)).type_as(logits)
        top_indices = select(scores if expert_bias is None else scores + expert_bias)
        probs = scores.gather(1, top_indices)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"moe_router_score_function={score_function!r}; use 'softmax' or 'sigmoid'")
    if scaling_factor:
        probs = probs * scaling_factor
    return (*_scatter_topk(logits, top_indices, probs), top_indices)


def compute_routing_scores_for_aux_loss(logits, topk: int, score_function: str):
    """The scores [T, E] and plain top-k map [T, E] the aux losses see: softmax, or sigmoid
    normalised over experts; no groups, no bias, no capacity."""
    if score_function == "softmax":
        scores = torch.softmax(widen(logits), dim=-1)
    else:
        scores = torch.sigmoid(widen(logits))
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top_indices = torch.topk(scores, k=topk, dim=-1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


@torch.no_grad()
def quantile_balancing_estimate(scores, topk: int, qb_beta):
    """Quantile Balancing: the per-expert bias that would give every expert ~T*k/E tokens.

    Each token's admission cutoff alpha_t is its (k+1)-th largest score - beta; an expert e then
    admits token t when scores[t, e] - alpha_t > beta_e. The estimate for expert e is the
    (q+1)-th largest of scores[:, e] - alpha over tokens, q = floor(T*k/E), so exactly q tokens
    clear it. Returns beta_new [E] (fp32).
    """
    scores = scores.float()
    num_tokens, num_experts = scores.shape
    cutoff = (scores - qb_beta).topk(topk + 1, dim=-1).values[:, -1:]
    target = min(num_tokens * topk // num_experts, num_tokens - 1)
    return (scores - cutoff).topk(target + 1, dim=0).values[-1]


# ----- capacity ---------------------------------------------------------------------------------

def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity=None) -> int:
    """Tokens one expert may take: ceil(num_tokens / num_experts * capacity_factor)."""
    capacity = math.ceil(num_tokens / num_experts * capacity_factor)
    return capacity if min_capacity is None else max(capacity, min_capacity)


def apply_router_token_dropping(routing_probs, routing_map, router_topk: int, capacity_factor: float,
                                drop_policy: str = "probs", pad_to_capacity: bool = False):
    """Keep at most C = ceil(T*k/E * capacity_factor) tokens per expert.

    drop_policy 'probs' keeps the highest-probability tokens, 'position' the earliest ones
    (ties go to the earlier token). With pad_to_capacity every expert takes exactly min(C, T)
    tokens: the kept ones plus unrouted tokens with weight 0. Returns (probs, map) [T, E].
    """
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        ranking = routing_probs.detach() if drop_policy == "probs" else routing_map.to(torch.int8)
        order = torch.sort(ranking, dim=0, descending=True, stable=True).indices[:capacity]
        keep = torch.zeros_like(routing_map).scatter(0, order, True)
    final_map = keep if pad_to_capacity else routing_map & keep
    return routing_probs * final_map, final_map


# ----- permutation ------------------------------------------------------------------------------

def permute(tokens, routing_map, probs=None):
    """Copy each token once per expert it goes to, grouped by expert (expert 0's tokens first,
    each group in token order).

    tokens [T, h], routing_map [T, E] -> permuted [N, h], permuted probs [N] (or None) and
    sorted_indices [N], the source token of each row.
    """
    num_tokens = tokens.shape[0]
    by_expert = routing_map.t().contiguous()  # [E, T]
    token_ids = torch.arange(num_tokens, device=tokens.device).unsqueeze(0).expand_as(by_expert)
    sorted_indices = token_ids.masked_select(by_expert)
    permuted_probs = None if probs is None else probs.t().contiguous().masked_select(by_expert)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted_tokens, sorted_indices, num_tokens: int):
    """Sum the rows back onto their source tokens: [N, h] -> [num_tokens, h]."""
    output = permuted_tokens.new_zeros((num_tokens, permuted_tokens.shape[-1]))
    return output.index_add(0, sorted_indices, permuted_tokens)


def sort_chunks_by_idxs(tensor, split_sizes, sorted_idxs):
    """Split `tensor` along dim 0 into chunks of `split_sizes` and concatenate them in the order
    `sorted_idxs` (lists of ints)."""
    chunks = torch.split(tensor, split_sizes, dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)
