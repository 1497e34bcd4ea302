"""Megatron's PackedSeqParams: the documents of a packed batch, given to the model instead of a
dense attention mask (`GPTModel.forward(..., packed_seq_params=...)`).

Each document attends causally to itself only; nothing of size s x s is built. Two layouts:

- 'thd' (Megatron's): the batch is one row [1, T] of documents back to back. Document i
  occupies positions [cu_seqlens_q_padded[i], cu_seqlens_q_padded[i + 1]) (cu_seqlens_q when
  there is no padding); its first cu_seqlens_q[i + 1] - cu_seqlens_q[i] tokens are real, the
  rest padding (which the loss mask hides; real tokens never attend to it, as it comes after
  them). Under context parallelism every document is split into 2 x CP chunks, rank r keeping
  chunks r and 2 x CP - 1 - r of each (per-document load balance), so every padded length must
  be divisible by 2 x CP.
- 'sbhd' (teratron's, for `--reset-attention-mask` pretraining batches): the batch keeps its
  rows [b, s]; the cu_seqlens index the row-major flattened b x s tokens and every row start is
  a document start. Context parallelism splits each row as it splits unpacked rows.

Only self-attention is packed: cu_seqlens_kv, when given, must equal cu_seqlens_q. The
cu_seqlens are int tensors on the model's device (any int dtype), or lists.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch

QKV_FORMATS = ("thd", "sbhd")


@dataclass
class PackedSeqParams:
    qkv_format: str = "thd"
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    # Derived per-forward data (the attention's token layouts), shared by every layer.
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.qkv_format not in QKV_FORMATS:
            raise ValueError(f"PackedSeqParams qkv_format={self.qkv_format!r}; use one of {QKV_FORMATS}")
        if self.cu_seqlens_q is None:
            raise ValueError("PackedSeqParams needs cu_seqlens_q (the document boundaries)")
        for kv, q in (("cu_seqlens_kv", "cu_seqlens_q"), ("cu_seqlens_kv_padded", "cu_seqlens_q_padded")):
            if getattr(self, kv) is not None and not _same(getattr(self, kv), getattr(self, q)):
                raise ValueError(f"PackedSeqParams {kv} differs from {q}: only self-attention is packed; "
                                 f"pass {kv}=None or equal to {q}")

    def to(self, device) -> "PackedSeqParams":
        """A copy with the cu_seqlens on `device`."""
        moved = {name: None if getattr(self, name) is None else torch.as_tensor(getattr(self, name)).to(
                     device, non_blocking=True)
                 for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")}
        return PackedSeqParams(qkv_format=self.qkv_format, max_seqlen_q=self.max_seqlen_q,
                               max_seqlen_kv=self.max_seqlen_kv, **moved)

    @property
    def boundaries(self) -> torch.Tensor:
        """Where documents start and end in the packed tokens (padding included)."""
        cu = self.cu_seqlens_q if self.cu_seqlens_q_padded is None else self.cu_seqlens_q_padded
        return torch.as_tensor(cu)


def _same(a, b) -> bool:
    return b is not None and torch.equal(torch.as_tensor(a).long().cpu(), torch.as_tensor(b).long().cpu())


def document_ids(params: PackedSeqParams, rows: int, row_length: int, device) -> torch.Tensor:
    """The document of every token, [rows, row_length] int64 ('thd': rows = 1). Tokens past the
    last boundary form one more document."""
    cu = params.boundaries.to(device=device, dtype=torch.int64)
    flat = torch.arange(rows * row_length, device=device)
    return (torch.searchsorted(cu[1:], flat, right=True)).view(rows, row_length)


def packed_rows(row_boundaries: torch.Tensor) -> PackedSeqParams:
    """The 'sbhd' PackedSeqParams of a batch whose rows carry their own documents' boundaries,
    [b, s + 1] int, each row's ascending from 0 to s and then -1 (GPTDataset's `cu_seqlens`)."""
    rows, width = row_boundaries.shape
    offsets = torch.arange(rows, device=row_boundaries.device)[:, None] * (width - 1)
    flat = (row_boundaries.long() + offsets)[row_boundaries >= 0]
    cu = torch.unique(flat).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def cu_seqlens_from_documents(documents: torch.Tensor) -> torch.Tensor:
    """int32 boundaries of the runs of equal ids in `documents` [b, s] taken row by row (a row
    start always starts a document): the 'sbhd' cu_seqlens of a batch."""
    b, s = documents.shape
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    flat_starts = torch.nonzero(starts.reshape(-1)).flatten()
    return torch.cat([flat_starts, flat_starts.new_tensor([b * s])]).to(torch.int32)
