"""CheckpointWithoutOutput: the outputs are freed while their consumer holds them, refilled when
backward reaches the consumer, and every gradient equals the plain backward's (dropout included)."""

import torch
import torch.nn.functional as F

from teratron.tensor_parallel import CheckpointWithoutOutput


def producer(x, w):
    a = torch.tanh(x @ w)
    return (a * 2).contiguous(), F.dropout(a, p=0.3, training=True).contiguous()


def run(discard: bool):
    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    if discard:
        checkpoint = CheckpointWithoutOutput()
        a, b = checkpoint.checkpoint(producer, x, w)
    else:
        a, b = producer(x, w)
    consumed = a * b  # mul keeps a and b themselves for backward
    sizes = None
    if discard:
        checkpoint.discard_output_and_register_recompute(consumed)
        sizes = (a.untyped_storage().nbytes(), b.untyped_storage().nbytes())
    (consumed.sin() * torch.arange(15.0).view(5, 3)).sum().backward()
    return x.grad, w.grad, sizes, (a.detach().clone(), b.detach().clone())


def test_outputs_freed_then_refilled_and_gradients_equal():
    x_grad, w_grad, _, outputs = run(discard=False)
    x_grad2, w_grad2, sizes, refilled = run(discard=True)
    assert sizes == (0, 0)  # both outputs emptied while the consumer held them
    for expected, actual in zip(outputs, refilled):
        assert torch.equal(actual, expected)  # refilled by the recompute, dropout mask replayed
    assert torch.equal(x_grad2, x_grad) and torch.equal(w_grad2, w_grad)


def test_without_discard_it_is_an_ordinary_recompute():
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    a, _ = CheckpointWithoutOutput().checkpoint(lambda x, w: (torch.tanh(x @ w), (x @ w).exp()), x, w)
    a.sum().backward()
    torch.testing.assert_close(x.grad, (1 - torch.tanh(x @ w) ** 2) @ w.detach().t())
