"""Enums of the transformer API (Megatron: `megatron.core.transformer.enums`)."""

import enum

from teratron.pipeline_parallel.layout import LayerType  # defined with the layout it describes


class ModelType(enum.Enum):
    """What the pipeline schedules are driving: a decoder-only (or encoder-only) stack."""

    encoder_or_decoder = 1


class AttnType(enum.Enum):
    """Self-attention (q, k, v from one input) or cross-attention."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """How the attention mask is given.

    padding: an explicit [b, 1, s, s] boolean mask (True = masked out); causal: the lower
    triangle, no tensor needed; no_mask: attend everywhere; padding_causal: both; arbitrary:
    any user mask tensor.
    """

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class AttnBackend(enum.Enum):
    """Which kernel runs core attention.

    flash / fused: `scaled_dot_product_attention` with its fast kernels; unfused / local: the
    explicit reference path (softmax(QK^T) V, in fp32 when attention_softmax_in_fp32); auto: the
    fastest one available for the inputs.
    """

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
