"""Rotary position embedding (RoPE) for q and k in the `[s, b, np, hn]` layout, and YaRN.

The first `rot_dim = kv_channels * rotary_percent` channels of each head rotate, the rest pass
through. Channel pairs are (i, i + rot_dim/2) by default (Llama) or (2i, 2i + 1) with
`rotary_interleaved` (RoFormer); pair i turns by angle position * base^(-2i / rot_dim).

YaRN (Peng et al. 2023, `YarnRotaryEmbedding`; position_embedding_type 'yarn' for plain
attention with the config's yarn_* fields, rope_type 'yarn' for multi-latent attention) stretches a model trained on
`original_max_position_embeddings` positions by `scaling_factor`: pair i keeps its frequency
f_i = base^(-2i / d) where its wavelength is short (more than `beta_fast` turns over the original
length), takes f_i / scaling_factor where it is long (fewer than `beta_slow` turns), and a linear
blend in between; the rotated channels are multiplied by the concentration factor
`yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim)`, and multi-latent attention multiplies
its softmax scale by `yarn_mscale(s, mscale_all_dim)^2` (DeepSeek-V2/V3, Megatron's MLA).

Llama 3.x scaling (Megatron's `rope_scaling`, `rope_scaling_factor`) stretches plain RoPE by
wavelength: pair i of wavelength w_i = 2 pi / f_i keeps f_i where w_i is shorter than
original / high_freq_factor, takes f_i / factor where w_i is longer than original /
low_freq_factor, and in between the blend (1 - r) f_i / factor + r f_i with
r = (original / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor). Megatron fixes
low_freq_factor 1, high_freq_factor 4 and original 8192 (Llama 3.1's); teratron takes them as
arguments with those defaults, so a Hugging Face config's own values carry over.
"""

import math

import torch


class RotaryEmbedding(torch.nn.Module):
    """Maps position ids [b, s] to rotation angles [s, b, 1, rot_dim] (the layout `apply` takes);
    with `rope_scaling`, Llama 3.x's frequencies (`llama3_inv_freq`)."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 rotary_base: float = 10000.0, rope_scaling: bool = False, rope_scaling_factor: float = 8.0,
                 rope_scaling_low_freq_factor: float = 1.0, rope_scaling_high_freq_factor: float = 4.0,
                 rope_scaling_original_max_position_embeddings: int = 8192):
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
        if rope_scaling:
            inv_freq = llama3_inv_freq(inv_freq, rope_scaling_factor, rope_scaling_low_freq_factor,
                                       rope_scaling_high_freq_factor, rope_scaling_original_max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        inv_freq = self.inv_freq.to(position_ids.device)
        angles = position_ids.t().float()[..., None] * inv_freq  # [s, b, rot/2]
        if self.rotary_interleaved:
            emb = angles.repeat_interleave(2, dim=-1)  # f0 f0 f1 f1 ...
        else:
            emb = torch.cat([angles, angles], dim=-1)  # f0 f1 ... f0 f1 ...
        return emb.unsqueeze(2)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float = 1.0,
                    high_freq_factor: float = 4.0, original_max_position_embeddings: int = 8192) -> torch.Tensor:
    """Llama 3.x's frequencies [rot_dim / 2] from RoPE's `inv_freq` (see the module docstring)."""
    if not high_freq_factor > low_freq_factor > 0 or factor <= 0 or original_max_position_embeddings < 1:
        raise ValueError(f"Llama 3 RoPE scaling needs high_freq_factor > low_freq_factor > 0, factor > 0 and "
                         f"original_max_position_embeddings >= 1; got {high_freq_factor}, {low_freq_factor}, "
                         f"{factor}, {original_max_position_embeddings}")
    wavelength = 2 * math.pi / inv_freq
    ratio = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - ratio) * inv_freq / factor + ratio * inv_freq
    short = wavelength < original_max_position_embeddings / high_freq_factor
    long = wavelength > original_max_position_embeddings / low_freq_factor
    return torch.where(short, inv_freq, torch.where(long, inv_freq / factor, blended))


def yarn_mscale(scaling_factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor 0.1 * mscale * ln(scaling_factor) + 1 (1 without scaling)."""
    if scaling_factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def yarn_concentration_factor(scaling_factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor YaRN multiplies the rotated channels (cos and sin) by."""
    return yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, original_max_positions: int) -> float:
    """The pair index (fractional) whose wavelength fits `num_rotations` times in the original length."""
    return dim * math.log(original_max_positions / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, scaling_factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float, round_to_int: bool = True) -> torch.Tensor:
    """YaRN's frequencies [dim / 2] (fp32): pairs below the correction range keep base^(-2i/dim),
    pairs above it are divided by scaling_factor, a linear ramp in between (range bounds rounded
    outwards to whole pairs with `round_to_int`, as Megatron and DeepSeek do; gpt-oss keeps them
    fractional)."""
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    interpolated = extrapolated / scaling_factor
    low = _yarn_correction_dim(beta_fast, dim, base, original_max_position_embeddings)
    high = _yarn_correction_dim(beta_slow, dim, base, original_max_position_embeddings)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair range: a step instead of a ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return interpolated * ramp + extrapolated * (1 - ramp)


class YarnRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding with YaRN's frequencies over all `kv_channels` channels; the caller
    multiplies the rotated channels by `yarn_concentration_factor` (see the module docstring)."""

    def __init__(self, kv_channels: int, rotary_interleaved: bool = False, rotary_base: float = 10000.0,
                 scaling_factor: float = 1.0, original_max_position_embeddings: int = 4096,
                 beta_fast: float = 32.0, beta_slow: float = 1.0, correction_range_round_to_int: bool = True):
        super().__init__(kv_channels, 1.0, rotary_interleaved, rotary_base)
        self.inv_freq.copy_(yarn_inv_freq(kv_channels, rotary_base, scaling_factor, original_max_position_embeddings,
                                          beta_fast, beta_slow, correction_range_round_to_int))


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                         mscale: float = 1.0) -> torch.Tensor:
    """Rotate t [s, b, np, hn] by angles freqs [s, b or 1, 1, rot_dim], the rotated channels
    scaled by `mscale` (YaRN's concentration factor)."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = (freqs.cos() * mscale).to(t.dtype), (freqs.sin() * mscale).to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)
