"""Sliding windows and attention sinks in the inference engine's padded prefill batches
(`DynamicInferenceContext._attend_batch`; decode and short chunks take them in the paged kernel).

What a layer needs, read once from its core attention (`SelfAttention.core_attention`, a
`DotProductAttention`) when the context is built:
- `window_size`: (left, right) on the layers that `window_attn_skip_freq` makes windowed, else
  None. A query at position p sees the keys at positions p - left .. p (causal: right plays no
  part); -1 means unbounded.
- `softmax_offset`: the sink logits of this rank's heads [np] ('off-by-one': zeros, 'learnable':
  the trained parameter), or None. Every query's softmax gets exp(z) in its denominator.

`window_mask` replaces the context's causal mask of a prefill batch; `attend` replaces its SDPA
call (plain SDPA without a sink; with one, the explicit softmax with the sink's column).
"""

import torch
import torch.nn.functional as F


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window=None) -> torch.Tensor:
    """bool [..., Q, K], True = attend: query_positions [..., Q] and key_positions [K] broadcast;
    each query sees the keys at or before its position, with `window` (left, right) at most left
    positions before it."""
    distance = query_positions[..., :, None] - key_positions  # [..., Q, K]: how far each key lies back
    allowed = distance >= 0
    if window is not None and window[0] >= 0:
        allowed &= distance <= window[0]
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           sink: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, np, Q, hn], k and v [R, ng, K, hn], mask bool broadcastable to [R, np, Q, K] (True =
    attend) -> [R, np, Q, hn]; `sink` [np]: one more logit per head in every softmax."""
    heads, groups = q.shape[1], k.shape[1]
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != groups)
    k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
    scores = (torch.matmul(q, k.transpose(-2, -1)).float() * scale).masked_fill(~mask, float("-inf"))
    sink_column = sink.float().view(1, heads, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
