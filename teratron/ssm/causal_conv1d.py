"""Mamba's short causal depthwise convolution: y_t = sum_{i < k} w_i x_{t - k + 1 + i} (+ bias), per
channel, each output seeing only its own and earlier tokens.

x [b, s, c], weight [c, k], bias [c] or None, initial_state [b, c, k - 1] or None (the last k - 1
inputs before this sequence; zeros when None) -> (y [b, s, c], final state [b, c, k - 1]: the last
k - 1 inputs, what the next call of a decoding step continues from).
"""

import torch
import torch.nn.functional as F


def causal_conv1d(x, weight, bias=None, initial_state=None):
    k = weight.shape[-1]
    channels_first = x.transpose(1, 2)  # [b, c, s]
    if initial_state is None:
        padded = F.pad(channels_first, (k - 1, 0))
    else:
        padded = torch.cat([initial_state.to(x.dtype), channels_first], dim=-1)
    y = F.conv1d(padded, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return y.transpose(1, 2), padded[..., padded.shape[-1] - (k - 1):]
