"""Rotary position embedding (RoPE) for q and k in the `[s, b, np, hn]` layout.

The first `rot_dim = kv_channels * rotary_percent` channels of each head rotate, the rest pass
through. Channel pairs are (i, i + rot_dim/2) by default (Llama) or (2i, 2i + 1) with
`rotary_interleaved` (RoFormer); pair i turns by angle position * base^(-2i / rot_dim).
"""

import torch


class RotaryEmbedding(torch.nn.Module):
    """Maps position ids [b, s] to rotation angles [s, b, 1, rot_dim] (the layout `apply` takes)."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 rotary_base: float = 10000.0):
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent={rotary_percent} must be in (0, 1]")
        rot_dim = int(kv_channels * rotary_percent)
        if rot_dim < 2 or rot_dim % 2:
            raise ValueError(
                f"kv_channels ({kv_channels}) * rotary_percent ({rotary_percent}) = {rot_dim} rotary "
                f"channels; it must be an even number >= 2"
            )
        self.rotary_interleaved = rotary_interleaved
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        inv_freq = self.inv_freq.to(position_ids.device)
        angles = position_ids.t().float()[..., None] * inv_freq  # [s, b, rot/2]
        if self.rotary_interleaved:
            emb = angles.repeat_interleave(2, dim=-1)  # f0 f0 f1 f1 ...
        else:
            emb = torch.cat([angles, angles], dim=-1)  # f0 f1 ... f0 f1 ...
        return emb.unsqueeze(2)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False) -> torch.Tensor:
    """Rotate t [s, b, np, hn] by angles freqs [s, b or 1, 1, rot_dim]."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)
