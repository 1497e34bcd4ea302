"""The causal convolution's PyTorch path with packed documents (seq_idx): each document as if run alone
(a row's first one from the initial state, if any)."""

import pytest
import torch

from ssm.causal_conv1d_triton_cases import make_inputs
from ssm.packed_documents import documents, seq_idx_of
from teratron.ssm.causal_conv1d import causal_conv1d

# Two rows of documents (k = 4): lengths 1 and 2, longer than k, one at a row's start and end; the first
# row ends in a document shorter than k - 1 (its final state reaches into the zeros before it).
LENGTHS = [[3, 1, 6, 2], [5, 1, 2, 4]]


def grads_of(x, weight, bias, upstream, seq_idx=None):
    """(y, final state, dx, dweight, dbias) of causal_conv1d with `upstream` as y's gradient."""
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    y, final_state = causal_conv1d(*leaves, seq_idx=seq_idx)
    return (y.detach(), final_state.detach(), *torch.autograd.grad(y, leaves, upstream))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32, torch.uint8])
def test_packed_documents_match_each_document_run_alone(index_dtype):
    """float64: the output of every document, the gradients of its tokens and its last tokens' final
    state equal those of the document run alone (from a zero state); the weight's and bias's gradients
    the sum over the documents."""
    x, weight, bias = (t.double() for t in make_inputs(2, 12, 5, 4, True, False))
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, final_state, dx, dweight, dbias = grads_of(x, weight, bias, upstream, seq_idx_of(*LENGTHS, dtype=index_dtype))
    dweight_sum, dbias_sum = torch.zeros_like(dweight), torch.zeros_like(dbias)
    for row, part in documents(LENGTHS):
        alone = [t[row:row + 1, part] for t in (x, upstream)]
        y_alone, final_alone, dx_alone, dweight_alone, dbias_alone = grads_of(alone[0], weight, bias, alone[1])
        torch.testing.assert_close(y[row:row + 1, part], y_alone, rtol=0, atol=0)
        torch.testing.assert_close(dx[row:row + 1, part], dx_alone, rtol=0, atol=0)
        dweight_sum, dbias_sum = dweight_sum + dweight_alone, dbias_sum + dbias_alone
        if part.stop == x.shape[1]:  # the row's last document: what continuing it starts from
            torch.testing.assert_close(final_state[row:row + 1], final_alone, rtol=0, atol=0)
    torch.testing.assert_close(dweight, dweight_sum)
    torch.testing.assert_close(dbias, dbias_sum)


def test_an_initial_state_continues_each_rows_first_document():
    """As in the scans: each row's first document continues from its initial state, the others start
    from zeros."""
    x, weight, bias = (t.double() for t in make_inputs(2, 12, 5, 4, True, False))
    state = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y, _ = causal_conv1d(x, weight, bias, initial_state=state, seq_idx=seq_idx_of(*LENGTHS))
    for row, part in documents(LENGTHS):
        first = part.start == 0
        alone, _ = causal_conv1d(x[row:row + 1, part], weight, bias, initial_state=state[row:row + 1] if first else None)
        torch.testing.assert_close(y[row:row + 1, part], alone, rtol=0, atol=0)
