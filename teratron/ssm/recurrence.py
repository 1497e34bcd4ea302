"""Running a recurrent mixer over a layer's tokens: the sequences of a training batch, each from a
zero state, or an inference step's tokens, each request's from the state its earlier tokens left
(kept by the engine's context).

Packed documents (`--sequence-packing`, `--reset-attention-mask`: the layer's attention_mask is a
PackedSeqParams) reach the mixers as `seq_idx` [b, s], the document of every token (mamba_ssm's
name): each document then starts from a zero state, as if run alone. The short convolution masks
its taps from other documents; the scans add DOCUMENT_START_LOG_DECAY to the log-decay of each
document's first token (`start_log_decay`), which drops the state before it.
"""

import torch

from teratron.packed_seq_params import PackedSeqParams, document_ids

# The log-decay added at a document's first token: exp(-128) underflows fp32 to 0, so the state
# entering the document is dropped exactly (in float64 it is scaled by 2.6e-56); finite, so the
# scans' running sums of log-decays stay finite (-inf would make their differences NaN). Decays
# within a chunk that holds a document start are then differences of sums past 128, rounded to
# fp32 at that size (an absolute 8e-6 in the exponent; the decays' own running sums reach that
# size within a chunk anyway at Mamba's larger dt).
DOCUMENT_START_LOG_DECAY = -128.0


def document_starts(seq_idx: torch.Tensor) -> torch.Tensor:
    """seq_idx [b, s] -> [b, s] bool: where a token's document differs from the token before's (a
    row's first token: False, no state comes before it)."""
    starts = torch.zeros(seq_idx.shape, dtype=torch.bool, device=seq_idx.device)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return starts


def start_log_decay(seq_idx: torch.Tensor) -> torch.Tensor:
    """seq_idx [b, s] -> [b, s] fp32: DOCUMENT_START_LOG_DECAY at each document's first token, else 0."""
    return document_starts(seq_idx).float() * DOCUMENT_START_LOG_DECAY


def packed_document_index(attention_mask, rows: int, row_length: int, device) -> torch.Tensor | None:
    """The document of every token [rows, row_length] int32 when a layer's attention_mask is packed
    documents (a PackedSeqParams, kept in its per-batch cache for the other layers), else None."""
    if not isinstance(attention_mask, PackedSeqParams):
        return None
    key = ("seq_idx", rows, row_length)
    if key not in attention_mask.cache:
        attention_mask.cache[key] = document_ids(attention_mask, rows, row_length, device).to(torch.int32)
    return attention_mask.cache[key]


def mix_tokens(mix, projected, layer_number: int, inference_context=None, attention_mask=None):
    """projected [s, b, c] -> [s, b, c'] by `mix(x [b, s, c], state, seq_idx=None) -> (y [b, s, c'],
    state)`: over the batch from zero states (each packed document from its own, when
    attention_mask is a PackedSeqParams), or with `inference_context` ([t, 1, c], requests back to
    back) through its `run_recurrent`."""
    if inference_context is not None:
        return inference_context.run_recurrent(layer_number, projected, mix)
    s, b = projected.shape[:2]
    seq_idx = packed_document_index(attention_mask, b, s, projected.device)
    y, _ = mix(projected.transpose(0, 1), None, seq_idx)
    return y.transpose(0, 1)


def conv_state_bytes(conv1d: torch.nn.Conv1d) -> int:
    """One request's convolution state in inference: every channel's last kernel - 1 inputs, in the
    weights' dtype."""
    channels, _, taps = conv1d.weight.shape
    return channels * (taps - 1) * conv1d.weight.element_size()
