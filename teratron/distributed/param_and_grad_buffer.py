"""Contiguous grad (and, for the distributed optimizer, param) buffers cut into buckets.

One `_ParamAndGradBuffer` holds every parameter of one (param dtype, grad dtype) pair of a
model chunk; each parameter's `main_grad` (and, with the distributed optimizer, its `.data`)
is a view into it. A buffer is cut into buckets: one collective each. Parameters are laid
out in reverse registration order, which is roughly the order backward produces their
grads, so the first bucket is ready first. With `copy_engine_collectives` both buffers live
in symmetric memory and the bucket collectives are copy-engine pulls (`copy_engine.py`).

The distributed optimizer's layout is defined here and nowhere else: every bucket is padded to
a multiple of lcm(DP size, 128), and data-parallel rank r owns the r-th equal, aligned,
contiguous slice of each bucket (`_ParamAndGradBucket.shard_range`), hence a piece of each
parameter in it (`_ParamAndGradBuffer.param_shard_range`). The optimizer keeps master weights and
states for those pieces only and writes its updates into them; the buckets' all-gathers then
bring every rank's pieces to every rank (`start_param_sync` / `finish_param_sync`).
"""

import math

import torch
import torch.distributed as dist

from teratron import comm
from teratron.distributed.copy_engine import CopyEngineCollectives, check_copy_engine_group, symmetric_zeros
from teratron.process_groups import get_pg_rank, get_pg_size


class _ParamAndGradBucket:
    """A contiguous slice of a buffer whose grads are reduced (and params gathered) together."""

    def __init__(self, buffer, params, offset, numel, bucket_id):
        self.buffer = buffer
        self.params = params
        self.offset = offset
        self.numel = numel
        self.bucket_id = bucket_id
        self.grad_data = buffer.grad_data[offset:offset + numel]
        self.param_data = None if buffer.param_data is None else buffer.param_data[offset:offset + numel]
        self.is_last_microbatch = True
        self.param_gather_handle = None   # the all-gather in flight, if any
        self.reset()

    def reset(self):
        self.params_with_grad = set()
        self.grad_reduce_handle = None
        self.grad_reduce_started = False

    # ----- layout -------------------------------------------------------------------------------

    def shard_range(self) -> tuple[int, int]:
        """[start, end) of the slice of this bucket that this data-parallel rank owns under the
        distributed optimizer (its grads are reduced here, its params updated here), relative
        to the bucket's start."""
        shard = self.numel // self.buffer.dp_size
        start = self.buffer.dp_rank * shard
        return start, start + shard

    def _shard(self, tensor):
        start, end = self.shard_range()
        return tensor[start:end]

    # ----- gradient reduction -------------------------------------------------------------------

    def register_grad_ready(self, param):
        """Called by the grad hook; the last grad of the bucket launches its reduction."""
        if not self.is_last_microbatch:
            return
        assert param not in self.params_with_grad, "a parameter's grad was reported ready twice"
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    def start_grad_sync(self):
        assert not self.grad_reduce_started, "grad reduction already started for this bucket"
        buffer, config = self.buffer, self.buffer.ddp_config
        if config.check_for_nan_in_grad:
            norm = self.grad_data.float().norm()
            if not torch.isfinite(norm):
                raise RuntimeError(
                    f"rank {dist.get_rank() if dist.is_initialized() else 0}: NaN or Inf in local "
                    f"gradients before the data-parallel reduce (bucket {self.bucket_id}, norm {norm.item()})")
        async_op = config.overlap_grad_reduce and buffer.dp_size > 1
        self.grad_reduce_started = True
        if buffer.copy_engine is not None:
            divisor = buffer.dp_size if config.average_in_collective else 1
            self.grad_reduce_handle = buffer.copy_engine.reduce_scatter(
                self.offset, self.numel, buffer.gradient_scaling_factor / divisor, async_op)
            return
        op = dist.ReduceOp.AVG if config.average_in_collective else dist.ReduceOp.SUM
        scale = buffer.gradient_scaling_factor
        if scale != 1.0 and op == dist.ReduceOp.SUM and buffer.dp_size > 1 and buffer.nccl:
            # NCCL multiplies each rank's input by `scale` as it sums: the same values as the
            # multiply below, without a pass over the whole fp32 bucket.
            op = dist._make_nccl_premul_sum(scale)
        elif scale != 1.0:
            self.grad_data.mul_(scale)
        if buffer.dp_size == 1:
            return
        if config.use_distributed_optimizer:
            self.grad_reduce_handle = comm.reduce_scatter_tensor(
                self._shard(self.grad_data), self.grad_data, buffer.data_parallel_group, op, async_op)
        elif async_op:
            self.grad_reduce_handle = dist.all_reduce(
                self.grad_data, op=op, group=buffer.data_parallel_group, async_op=True)
        else:
            dist.all_reduce(self.grad_data, op=op, group=buffer.data_parallel_group)

    def finish_grad_sync(self):
        """Wait for this bucket's reduction, launching it first if no hook did (e.g. no_sync
        microbatches before, unused params, or overlap off)."""
        if not self.grad_reduce_started:
            self.start_grad_sync()
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
        self.reset()

    # ----- parameter all-gather (distributed optimizer) ----------------------------------------

    def start_param_sync(self, async_op: bool = False):
        """All-gather every rank's slice of the bucket's params: wait for it now, or (async_op)
        keep its handle for `finish_param_sync`."""
        self.finish_param_sync()  # a gather still in flight writes the same buffer
        if self.buffer.dp_size == 1:
            return
        if self.buffer.copy_engine is not None:
            self.param_gather_handle = self.buffer.copy_engine.all_gather(self.offset, self.numel, async_op)
            return
        self.param_gather_handle = comm.all_gather_into_tensor(
            self.param_data, self._shard(self.param_data), self.buffer.data_parallel_group, async_op)

    def finish_param_sync(self):
        """Wait for this bucket's all-gather if one is in flight (forward pre-hook)."""
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None


class _ParamAndGradBuffer:
    """Grad buffer (+ param buffer with the distributed optimizer) for params of one dtype pair."""

    def __init__(self, ddp_config, param_dtype, grad_dtype, params, data_parallel_group,
                 bucket_size, gradient_scaling_factor, tied_embedding_params=()):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = list(params)
        self.data_parallel_group = data_parallel_group
        self.dp_size = get_pg_size(data_parallel_group)
        self.dp_rank = get_pg_rank(data_parallel_group)
        self.nccl = self.dp_size > 1 and dist.get_backend(data_parallel_group) == "nccl"
        self.gradient_scaling_factor = gradient_scaling_factor

        self.tied_embedding_params = set(tied_embedding_params)
        self.param_index_map = {}   # param -> (start, end, bucket_id) in buffer coordinates
        bucket_ranges = self._layout(bucket_size)
        self.numel = bucket_ranges[-1][1] if bucket_ranges else 0
        device = self.params[0].device
        if ddp_config.copy_engine_collectives:
            check_copy_engine_group(data_parallel_group, device)
        copy_engine = ddp_config.copy_engine_collectives and self.dp_size > 1

        def zeros(dtype):
            if copy_engine:  # peers pull from it
                return symmetric_zeros(self.numel, dtype, device)
            return torch.zeros(self.numel, dtype=dtype, device=device)

        self.grad_data = zeros(grad_dtype)
        self.param_data = None
        if ddp_config.use_distributed_optimizer:
            self.param_data = zeros(param_dtype)
        with torch.no_grad():
            for param, (start, end, _) in self.param_index_map.items():
                if self.param_data is not None:
                    self.param_data[start:end].copy_(param.data.reshape(-1))
                    param.data = self.param_data[start:end].view(param.shape)
                param.main_grad = self.grad_data[start:end].view(param.shape)

        self.buckets = []
        for bucket_id, (start, end, bucket_params) in enumerate(bucket_ranges):
            self.buckets.append(_ParamAndGradBucket(self, bucket_params, start, end - start, bucket_id))
        self.copy_engine = None
        if copy_engine:
            self.copy_engine = CopyEngineCollectives(data_parallel_group, self.grad_data, self.param_data,
                                                     max(bucket.numel for bucket in self.buckets))

    def _pad(self, numel):
        """Bucket ends are padded so every DP rank owns an equal, aligned slice."""
        if not self.ddp_config.use_distributed_optimizer:
            return numel
        if self.ddp_config.pad_buckets_for_high_nccl_busbw:
            divisor = self.dp_size * 2 ** 16
        else:
            divisor = math.lcm(self.dp_size, 128)
        return math.ceil(numel / divisor) * divisor

    def _layout(self, bucket_size):
        """Assign params (reverse order) to [start, end) ranges and cut buckets."""
        ranges, bucket_params, bucket_start, index = [], [], 0, 0

        def close_bucket():
            nonlocal bucket_params, bucket_start, index
            end = self._pad(index)
            ranges.append((bucket_start, end, bucket_params))
            bucket_params, bucket_start, index = [], end, end

        for param in reversed(self.params):
            # Under the distributed optimizer a tied embedding copy gets a bucket of its own, so
            # its DP slices cover the same elements on the first and last pipeline stage and the
            # embedding-group all-reduce of main_grad adds matching slices.
            own_bucket = self.ddp_config.use_distributed_optimizer and param in self.tied_embedding_params
            if own_bucket and bucket_params:
                close_bucket()
            self.param_index_map[param] = (index, index + param.numel(), len(ranges))
            index += param.numel()
            bucket_params.append(param)
            if own_bucket or (bucket_size is not None and index - bucket_start >= bucket_size):
                close_bucket()
        if bucket_params:
            close_bucket()
        return ranges

    # ----- the distributed optimizer's layout ------------------------------------------------------

    def param_shard_range(self, param) -> tuple[int, int]:
        """[start, end) of `param`'s flattened elements that this data-parallel rank owns under the
        distributed optimizer: the part of the param inside its bucket's `shard_range()`, (0, 0)
        when that slice misses the param. A param crossing slice boundaries has pieces on
        several ranks; the pieces of all ranks cover the param exactly once."""
        p_start, p_end, bucket_id = self.param_index_map[param]
        bucket = self.buckets[bucket_id]
        shard_start, shard_end = bucket.shard_range()
        lo, hi = max(p_start, bucket.offset + shard_start), min(p_end, bucket.offset + shard_end)
        return (lo - p_start, hi - p_start) if lo < hi else (0, 0)

    def reset(self):
        """Zero the grads and forget reduction state (start of an iteration)."""
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()

    def scale_gradients(self, scaling_factor):
        self.grad_data.mul_(scaling_factor)
