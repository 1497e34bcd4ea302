"""Packed documents for the recurrent layers' tests: seq_idx from each row's document lengths, and
the check that a layer runs each packed document as it runs the document alone."""

import torch
from torch.testing import assert_close

from teratron.packed_seq_params import PackedSeqParams, cu_seqlens_from_documents


def seq_idx_of(*rows, dtype=torch.int32):
    """[len(rows), s]: the document of every token, from each row's document lengths (numbered on
    across the rows, as Megatron numbers a batch's)."""
    counts = [len(lengths) for lengths in rows]
    firsts = [sum(counts[:row]) for row in range(len(rows))]
    return torch.stack([torch.repeat_interleave(torch.arange(first, first + len(lengths)), torch.tensor(lengths))
                        for first, lengths in zip(firsts, rows)]).to(dtype)


def gpu_documents(seq: int):
    """Two rows of `seq` tokens (at least 260) of documents for the GPU tests: documents of one token,
    one of 127 that ends on a chunk boundary of 64 and 128, documents crossing many chunks."""
    third = seq // 3
    return [1, 127, 1, seq - 129], [third, 1, 1, seq - third - 2]


def documents(rows):
    """(row, token slice) of every document of `rows` (each row's document lengths), in order."""
    for row, lengths in enumerate(rows):
        start = 0
        for length in lengths:
            yield row, slice(start, start + length)
            start += length


def assert_documents_run_as_alone(layer, x, rows, tol):
    """`layer` ([s, b, h] -> ([s, b, h], _)) on x with attention_mask the 'sbhd' PackedSeqParams of
    `rows` (as --reset-attention-mask batches come) against the layer on each document alone: the
    output and x's gradient per document, the parameters' gradients summed over the documents."""
    cu = cu_seqlens_from_documents(seq_idx_of(*rows))
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    params = list(layer.parameters())

    def run(x, upstream, attention_mask=None):
        x = x.detach().clone().requires_grad_()
        out = layer(x, attention_mask=attention_mask)[0]
        return out.detach(), torch.autograd.grad((out * upstream).sum(), [x, *params])

    out, (dx, *dparams) = run(x, upstream, packed)
    dparams_alone = [torch.zeros_like(p) for p in params]
    for row, part in documents(rows):
        alone, (dx_alone, *grads) = run(x[part, row:row + 1], upstream[part, row:row + 1])
        assert_close(out[part, row:row + 1], alone, rtol=tol, atol=tol)
        assert_close(dx[part, row:row + 1], dx_alone, rtol=tol, atol=tol)
        dparams_alone = [total + grad for total, grad in zip(dparams_alone, grads)]
    for (name, _), got, want in zip(layer.named_parameters(), dparams, dparams_alone):
        assert_close(got, want, rtol=tol, atol=tol, msg=name)
