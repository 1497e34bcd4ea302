"""Mamba's short causal depthwise convolution: y_t = sum_{i < k} w_i x_{t - k + 1 + i} (+ bias), per
channel, each output seeing only its own and earlier tokens.

x [b, s, c], weight [c, k], bias [c] or None, initial_state [b, c, k - 1] or None (the last k - 1
inputs before this sequence; zeros when None) -> (y [b, s, c], final state [b, c, k - 1]: the last
k - 1 inputs, what the next call of a decoding step continues from).

Computed as k shifted multiply-adds in fp32 (as cuDNN accumulates; wider dtypes stay wider), in x's [b, s, c] layout: under
`--torch-compile` Inductor fuses them with the bias and the SiLU after into one kernel each way,
where a depthwise F.conv1d would need transposes and runs slow kernels both ways.

`causal_conv1d_silu` is what the mixers call: silu(causal_conv1d(...)) by Triton kernels
(teratron.ssm.causal_conv1d_triton: one pass forward and two backward, where the compiled shifted adds
recomputed the convolution in each of the backward's kernels) on CUDA tensors from a zero state with kernels of
at most 4 taps, by this module's PyTorch path elsewhere (the CPU, longer kernels, and decoding steps that
continue a state).
"""

import torch.nn.functional as F
import torch

from teratron.ssm.causal_conv1d_triton import causal_conv1d_silu_triton, runs_here


def causal_conv1d(x, weight, bias=None, initial_state=None):
    k, s = weight.shape[-1], x.shape[1]
    if initial_state is None:
        padded = F.pad(x, (0, 0, k - 1, 0))  # [b, k - 1 + s, c]
    else:
        padded = torch.cat([initial_state.transpose(1, 2).to(x.dtype), x], dim=1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    taps = weight.to(dtype)
    y = padded[:, :s].to(dtype) * taps[:, 0]
    for i in range(1, k):
        y = y + padded[:, i:i + s].to(dtype) * taps[:, i]
    if bias is not None:
        y = y + bias.to(dtype)
    return y.to(x.dtype), padded[:, s:].transpose(1, 2)


def causal_conv1d_silu(x, weight, bias=None, initial_state=None):
    """(silu(y), final state) of `causal_conv1d`'s arguments: the Triton kernels where they run."""
    if not runs_here(x, weight, initial_state):
        y, final_state = causal_conv1d(x, weight, bias, initial_state)
        return F.silu(y), final_state
    k, s = weight.shape[-1], x.shape[1]
    last_inputs = F.pad(x[:, max(s - (k - 1), 0):], (0, 0, max(k - 1 - s, 0), 0))  # [b, k - 1, c]
    return causal_conv1d_silu_triton(x, weight, bias), last_inputs.transpose(1, 2)
