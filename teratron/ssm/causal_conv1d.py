"""Mamba's short causal depthwise convolution: y_t = sum_{i < k} w_i x_{t - k + 1 + i} (+ bias), per
channel, each output seeing only its own and earlier tokens.

x [b, s, c], weight [c, k], bias [c] or None, initial_state [b, c, k - 1] or None (the last k - 1
inputs before this sequence; zeros when None) -> (y [b, s, c], final state [b, c, k - 1]: the last
k - 1 inputs, what the next call of a decoding step continues from).

seq_idx [b, s] (any integer dtype) or None: packed documents (Megatron's sequence packing, mamba_ssm's
seq_idx), the document of every token, each document's tokens contiguous in their row. No output reads
across a document's start: taps from another document count as zeros, as if each document ran alone
from a zero state (an initial_state continues each row's first document, as in the scans); the final
state keeps the last document's inputs alone (what continuing it needs).

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


def causal_conv1d(x, weight, bias=None, initial_state=None, seq_idx=None):
    k, s = weight.shape[-1], x.shape[1]
    if initial_state is None:
        padded = F.pad(x, (0, 0, k - 1, 0))  # [b, k - 1 + s, c]
    else:
        padded = torch.cat([initial_state.transpose(1, 2).to(x.dtype), x], dim=1)
    if seq_idx is not None:
        # the document of each row of padded: the k - 1 rows before a row (zeros or the initial state)
        # are its first document's
        documents = seq_idx.to(torch.int64)
        padded_documents = torch.cat([documents[:, :1].expand(-1, k - 1), documents], dim=1)  # [b, k - 1 + s]
    dtype = torch.promote_types(x.dtype, torch.float32)
    taps = weight.to(dtype)

    def tap_inputs(i):
        """What tap i reads for each output: zeros where its token is in another document than the output's."""
        inputs = padded[:, i:i + s].to(dtype)
        if seq_idx is None:
            return inputs
        return torch.where((padded_documents[:, i:i + s] == documents)[..., None], inputs, 0.0)

    y = tap_inputs(0) * taps[:, 0]
    for i in range(1, k):
        y = y + tap_inputs(i) * taps[:, i]
    if bias is not None:
        y = y + bias.to(dtype)
    last_inputs = padded[:, s:]  # [b, k - 1, c]
    if seq_idx is not None:
        last_inputs = _of_the_last_document(last_inputs, padded_documents[:, s:], documents)
    return y.to(x.dtype), last_inputs.transpose(1, 2)


def _of_the_last_document(last_inputs, their_documents, documents):
    """last_inputs [b, k - 1, c] with the rows whose document (their_documents [b, k - 1]) is not the
    last token's zeroed."""
    return torch.where((their_documents == documents[:, -1:])[..., None], last_inputs, 0.0)


def causal_conv1d_silu(x, weight, bias=None, initial_state=None, seq_idx=None):
    """(silu(y), final state) of `causal_conv1d`'s arguments: the Triton kernels where they run."""
    if not runs_here(x, weight, initial_state):
        y, final_state = causal_conv1d(x, weight, bias, initial_state, seq_idx)
        return F.silu(y), final_state
    k, s = weight.shape[-1], x.shape[1]
    first = max(s - (k - 1), 0)
    last_inputs = F.pad(x[:, first:], (0, 0, k - 1 - (s - first), 0))  # [b, k - 1, c]
    if seq_idx is not None:  # the rows of padding before a short sequence are zeros whatever they match
        documents = seq_idx.to(torch.int64)
        last_inputs = _of_the_last_document(last_inputs, F.pad(documents[:, first:], (k - 1 - (s - first), 0)),
                                            documents)
    return causal_conv1d_silu_triton(x, weight, bias, seq_idx), last_inputs.transpose(1, 2)
