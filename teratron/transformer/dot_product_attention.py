"""Core attention: softmax(q k^T * scale + mask) v over this rank's heads.

Two paths with one meaning: `scaled_dot_product_attention` (flash, cuDNN or memory-efficient
kernels on GPU, see `_SDPA_BACKENDS`) and an explicit reference (`attention_backend` unfused /
local) that materialises the scores, softmax in fp32 when `attention_softmax_in_fp32`. Masks follow Megatron: a boolean
tensor broadcastable to [b, np, sq, sk] with True = masked out; None with a causal mask type
means the lower triangle. Dropout of attention probabilities runs under the tensor-parallel RNG
tracker, since every TP rank holds different heads.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from teratron import tensor_parallel
from teratron.transformer.enums import AttnBackend, AttnMaskType

_REFERENCE_BACKENDS = (AttnBackend.unfused, AttnBackend.local)
# On CUDA, `flash` pins SDPA to the flash kernel and `fused` to cuDNN's fused attention (what
# Megatron's 'fused' means: Transformer Engine's cuDNN backend); `auto` keeps SDPA's own choice.
_SDPA_BACKENDS = {
    AttnBackend.flash: [SDPBackend.FLASH_ATTENTION],
    AttnBackend.fused: [SDPBackend.CUDNN_ATTENTION],
}


def _sdpa_backends(backend: AttnBackend, on_cuda: bool):
    if on_cuda and backend in _SDPA_BACKENDS:
        return _pinned_sdpa(backend)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _pinned_sdpa(backend: AttnBackend):
    with sdpa_kernel(_SDPA_BACKENDS[backend]):
        try:
            yield
        except RuntimeError as error:
            if "No available kernel" not in str(error):
                raise
            raise RuntimeError(
                f"attention_backend={backend.name}: SDPA's {backend.name} kernel cannot run these inputs (e.g. fp32, "
                "an explicit attention mask, or an unsupported head size); use attention_backend auto") from error


class DotProductAttention(torch.nn.Module):
    """Takes q [sq, b, np, hn] and k, v [sk, b, ng, hn] (ng query groups); returns [sq, b, np * hn]."""

    def __init__(self, config, layer_number: int, attn_mask_type=AttnMaskType.causal,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.config = config
        self.attn_mask_type = attn_mask_type
        self.use_reference = config.attention_backend in _REFERENCE_BACKENDS
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.softmax_scale = softmax_scale
        # Query-key layer scaling divides the scores by the layer number before the softmax input
        # is upcast and multiplies it back afterwards: the same math, a smaller fp16 range.
        self.layer_scale = max(1, layer_number) if config.apply_query_key_layer_scaling else 1

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        is_causal = attention_mask is None and mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
            if self.use_reference:
                out = self._reference(q, k, v, attention_mask, is_causal, dropout_p)
            else:
                with _sdpa_backends(self.config.attention_backend, q.is_cuda):
                    out = F.scaled_dot_product_attention(
                        q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
                        dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
                        enable_gqa=q.shape[1] != k.shape[1],
                    )
        b, n, s, hn = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * hn)

    def _reference(self, q, k, v, attention_mask, is_causal, dropout_p):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (self.softmax_scale / self.layer_scale)
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        scores = scores * self.layer_scale
        if is_causal:
            sq, sk = scores.shape[-2:]
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if attention_mask is not None:
            # A query that may attend to nothing gets a zero context, as from SDPA (not NaN).
            probs = probs.masked_fill(attention_mask.all(dim=-1, keepdim=True), 0.0)
        probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
        return torch.matmul(probs, v)

