"""Which keys a query may see, and the largest attention logit over them (QK-clip's record).

    allowed_keys(q_idx, kv_idx, causal, window)     True where the query may attend the key
    max_attention_logits(q, k, scale, causal, ...)  each head's largest softmax_scale * q.k over them

Shared by core attention (`dot_product_attention`) and its context-parallel and packed blocks
(`context_parallel`).
"""

import functools

import torch


def allowed_keys(q_idx, kv_idx, causal: bool, window):
    """True where query q_idx may attend key kv_idx (index tensors that broadcast, or FlexAttention's
    scalars): keys up to the query when `causal`, within `window` (left, right) when given."""
    distance = q_idx - kv_idx  # how far the key lies before the query
    allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if left >= 0:
        allowed = allowed & (distance <= left)
    if right >= 0:
        allowed = allowed & (distance >= -right)
    return allowed


# Scores of one query chunk in `max_attention_logits`: 2**26 elements (256 MiB in fp32).
_MAX_LOGIT_CHUNK = 1 << 26


def _key_band(q0: int, q1: int, sk: int, causal: bool, window):
    """[lo, hi): the keys that queries q0 .. q1 - 1 may see at all (`allowed_keys`' band)."""
    left, right = window if window is not None else (-1, -1)
    lo = max(0, q0 - left) if left >= 0 else 0
    hi = sk
    if causal:
        hi = min(hi, q1)
    if right >= 0:
        hi = min(hi, q1 + right)
    return lo, max(lo, hi)


def _grouped_mask(attention_mask, groups: int, sq: int, sk: int):
    """A bool mask broadcastable to [b, np, sq, sk] as [b or 1, ng or 1, np/ng or 1, sq, sk]."""
    mask = attention_mask.reshape((1,) * (4 - attention_mask.dim()) + tuple(attention_mask.shape))
    mask = mask.expand(*mask.shape[:2], sq, sk)
    return mask.unsqueeze(1) if mask.shape[1] == 1 else mask.unflatten(1, (groups, -1))


@torch.no_grad()
def max_attention_logits(q, k, softmax_scale: float, causal: bool, window=None, attention_mask=None,
                         hidden_keys=None):
    """The largest pre-softmax logit, softmax_scale * q.k, of each query head [np] (fp32) over the
    batch, the queries and the keys each query may attend (`allowed_keys`, less `attention_mask`,
    True = masked out); -inf for a head that attends to nothing. q [b, np, sq, hn], k [b, ng, sk, hn].
    `hidden_keys(q0, q1)`, instead of causal, window and attention_mask: True where queries
    q0 .. q1 - 1 may not see a key, [b or 1, 1, q1 - q0, sk] (context-parallel blocks). The scores
    exist a chunk of queries at a time, over the chunk's key band only."""
    b, heads, sq, _ = q.shape
    groups, sk = k.shape[1], k.shape[2]
    q = q.unflatten(1, (groups, heads // groups))  # [b, ng, np/ng, sq, hn]: heads group by group
    k_t = k.unsqueeze(2).transpose(-2, -1)  # [b, ng, 1, hn, sk]
    mask = None if attention_mask is None else _grouped_mask(attention_mask, groups, sq, sk)
    positions = functools.partial(torch.arange, device=q.device)
    rows = max(1, _MAX_LOGIT_CHUNK // (b * heads * sk))
    largest = torch.full((groups, heads // groups), float("-inf"), device=q.device)
    for q0 in range(0, sq, rows):
        q1 = min(sq, q0 + rows)
        lo, hi = (0, sk) if hidden_keys is not None else _key_band(q0, q1, sk, causal, window)
        if lo == hi:
            continue
        scores = torch.matmul(q[..., q0:q1, :], k_t[..., lo:hi]).float() * softmax_scale  # [b, ng, np/ng, c, keys]
        if hidden_keys is not None:
            hidden = hidden_keys(q0, q1).unsqueeze(1)
        else:
            hidden = ~allowed_keys(positions(q0, q1)[:, None], positions(lo, hi)[None, :], causal, window)
            if mask is not None:
                hidden = hidden | mask[..., q0:q1, lo:hi]
        scores = scores.masked_fill(hidden, float("-inf"))
        largest = torch.maximum(largest, scores.amax(dim=(0, 3, 4)))
    return largest.flatten()
