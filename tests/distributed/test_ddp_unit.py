"""DDP on one process (no torch.distributed): buffer layout, hooks, no_sync, validation."""

import pytest
import torch

from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads


class _Config:
    calculate_per_token_loss = False


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))


def test_main_grads_are_views_into_buckets_in_backward_order():
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=27), _model())
    (buffer,) = ddp.buffers
    # Reverse registration order: the last layer's bias and weight (27 elements) fill bucket 0.
    assert [len(b.params) for b in buffer.buckets] == [2, 2]
    assert buffer.buckets[0].params[0] is ddp.module[1].bias
    assert all(b.numel % 128 == 0 for b in buffer.buckets)          # padded for equal DP slices
    for p in ddp.module.parameters():
        assert p.main_grad.data_ptr() >= buffer.grad_data.data_ptr()
        assert p.data.data_ptr() >= buffer.param_data.data_ptr()   # params live in the param buffer


def test_grad_hook_accumulates_into_main_grad_and_no_sync():
    ref = _model()
    x = torch.randn(5, 4)
    ref(x).sum().backward()
    ref(2 * x).sum().backward()
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(overlap_grad_reduce=True), _model())
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert not any(b.grad_reduce_started for b in ddp.buffers[0].buckets)
    ddp(2 * x).sum().backward()
    assert all(b.grad_reduce_started for b in ddp.buffers[0].buckets)
    finalize_model_grads([ddp])
    for p, r in zip(ddp.module.parameters(), ref.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, r.grad)
    ddp.zero_grad_buffer()
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in ddp.module.parameters())


def test_check_for_nan_in_grad_raises():
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(check_for_nan_in_grad=True), _model())
    ddp(torch.randn(2, 4)).sum().backward()
    ddp.module[0].weight.main_grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        finalize_model_grads([ddp])


def test_config_validation():
    with pytest.raises(ValueError, match="num_distributed_optimizer_instances"):
        DistributedDataParallelConfig(num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match="overlap_param_gather"):
        DistributedDataParallelConfig(overlap_param_gather=True)
    with pytest.raises(ValueError, match="bucket_size"):
        DistributedDataParallelConfig(bucket_size=0)
