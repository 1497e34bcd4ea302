"""DistributedDataParallel: Megatron's DDP with contiguous grad buffers and bucketed reduction.

Each trainable parameter gets `param.main_grad`, a view into a contiguous buffer (fp32 with
`grad_reduce_in_fp32`); a hook after grad accumulation adds `param.grad` into it and frees
`param.grad` (with gradient-accumulation fusion the layer's GEMM has added it already).
Gradients are averaged over the data-parallel (x context-parallel) group, or for expert
parameters (attribute `allreduce=False`) over the expert-data-parallel group, by one all-reduce
per bucket, or a reduce-scatter with the distributed optimizer.

With the distributed optimizer the buffers also hold the params, and DDP alone moves them: the
optimizer writes this rank's slice of each bucket (`param_shard_range` of the buffers) and calls
`start_param_sync()` at the end of its step; the all-gathers then run at once, or, with
`overlap_param_gather`, are launched in forward order and waited for by forward pre-hooks.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from teratron.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from teratron.distributed.param_and_grad_buffer import _ParamAndGradBuffer
from teratron.process_groups import ProcessGroupCollection, get_pg_size
from teratron.topology import resolve_pg_collection


def _is_expert_param(param):
    return not getattr(param, "allreduce", True)


class DistributedDataParallel(torch.nn.Module):
    """Wrap `module` for data parallelism.

    config: the model's TransformerConfig (reads `calculate_per_token_loss`).
    disable_bucketing: one bucket per buffer (Megatron passes True for all but the first
    virtual-pipeline chunk).
    """

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 disable_bucketing: bool = False, pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        self.pg_collection = pg_collection = resolve_pg_collection(pg_collection)
        self.dp_cp_group = pg_collection.dp_cp
        self.expt_dp_group = pg_collection.expt_dp

        bucket_size = ddp_config.bucket_size
        if bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * get_pg_size(self.dp_cp_group))
        # Without overlap one collective per buffer is fastest: nothing to hide it behind.
        if disable_bucketing or not ddp_config.overlap_grad_reduce:
            bucket_size = None
        self.bucket_size = bucket_size

        dense_scale, expert_scale = self._gradient_scaling_factors()
        params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = self._build_buffers([p for p in params if not _is_expert_param(p)],
                                           self.dp_cp_group, dense_scale)
        self.expert_parallel_buffers = self._build_buffers(
            [p for p in params if _is_expert_param(p)], self.expt_dp_group, expert_scale)
        self.param_to_bucket = {}
        for buffer in self.buffers + self.expert_parallel_buffers:
            for bucket in buffer.buckets:
                for param in bucket.params:
                    self.param_to_bucket[param] = bucket
        self._buckets_in_forward_order = self._forward_order(params)

        self._grad_accumulation_hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in params]
        self._param_gather_hooks = []
        if ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
            self.enable_forward_pre_hook()

    # ----- construction -------------------------------------------------------------------------

    def _gradient_scaling_factors(self):
        """Factors applied before the collective so the result is the data-parallel average.

        Expert grads are reduced over the (smaller) expert-DP group but are still an average
        over all data-parallel ranks' tokens, hence expt_dp / dp_cp with average_in_collective.
        """
        if getattr(self.config, "calculate_per_token_loss", False):
            return 1.0, 1.0
        dp_cp_size = get_pg_size(self.dp_cp_group)
        if self.ddp_config.average_in_collective:
            return 1.0, get_pg_size(self.expt_dp_group) / dp_cp_size
        return 1.0 / dp_cp_size, 1.0 / dp_cp_size

    def _tied_embedding_params(self):
        """Both copies of a word embedding held on two pipeline stages: the last stage's copy
        (attribute `shared_embedding`: the tied output layer's or the MTP stage's embedding) and,
        on the first stage, the word embedding."""
        tied = {p for p in self.module.parameters() if getattr(p, "shared_embedding", False)}
        copied = (getattr(self.module, "share_embeddings_and_output_weights", False)
                  or getattr(self.config, "mtp_num_layers", None))
        if copied and get_pg_size(self.pg_collection.pp) > 1:
            weight = self.module.shared_embedding_or_output_weight()
            if weight is not None:
                tied.add(weight)
        return tied

    def _build_buffers(self, params, group, scaling_factor):
        by_dtype = {}
        for param in params:
            grad_dtype = torch.float32 if self.ddp_config.grad_reduce_in_fp32 else param.dtype
            by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)
        tied = self._tied_embedding_params()
        return [_ParamAndGradBuffer(self.ddp_config, param_dtype, grad_dtype, group_params, group,
                                    self.bucket_size, scaling_factor, tied)
                for (param_dtype, grad_dtype), group_params in by_dtype.items()]

    def _forward_order(self, params):
        """Every bucket, in the order the forward first uses their params (the order of the
        param all-gathers, so the first layers' params arrive first)."""
        position = {param: i for i, param in enumerate(params)}
        return sorted({id(b): b for b in self.param_to_bucket.values()}.values(),
                      key=lambda b: min(position[p] for p in b.params))

    # ----- hooks --------------------------------------------------------------------------------

    def _grad_hook(self, param):
        if param.grad is not None:
            # With gradient-accumulation fusion the GEMM already added dW; .grad is a placeholder.
            if not getattr(param, "grad_added_to_main_grad", False):
                param.main_grad.add_(param.grad)
            param.grad = None
        param.grad_added_to_main_grad = False
        if self.ddp_config.overlap_grad_reduce:
            self.param_to_bucket[param].register_grad_ready(param)

    @torch.compiler.disable  # bookkeeping and collective launches: never traced into a layer's graph
    def _forward_pre_hook(self, module, args):
        for param in self._params_gathered_before[module]:
            self.param_to_bucket[param].finish_param_sync()

    def _param_gather_points(self) -> dict:
        """{module: the bucketed params to have gathered before it runs}: each module's own, except
        that a module compiled in place (`--torch-compile` layers) takes over its whole subtree: a
        hook on a module inside it would split its compiled graph at every linear layer."""
        compiled_owner = {}
        for module in self.module.modules():  # pre-order: outer compiled modules first
            if getattr(module, "_compiled_call_impl", None) is not None and module not in compiled_owner:
                for inner in module.modules():
                    compiled_owner[inner] = module
        points = {}
        for module in self.module.modules():
            owned = [p for p in module.parameters(recurse=False) if p in self.param_to_bucket]
            if owned:
                points.setdefault(compiled_owner.get(module, module), []).extend(owned)
        return points

    def enable_forward_pre_hook(self):
        """Gather params bucket by bucket just before the modules that use them run."""
        assert not self._param_gather_hooks, "forward pre-hooks are already enabled"
        self._params_gathered_before = self._param_gather_points()
        self._param_gather_hooks = [module.register_forward_pre_hook(self._forward_pre_hook)
                                    for module in self._params_gathered_before]

    def disable_forward_pre_hook(self, param_sync: bool = True):
        """Remove the pre-hooks (evaluation, checkpointing); gather all params now if asked."""
        for handle in self._param_gather_hooks:
            handle.remove()
        self._param_gather_hooks = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    # ----- public API ---------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _all_buffers(self):
        return self.buffers + self.expert_parallel_buffers

    def _all_buckets(self):
        return [bucket for buffer in self._all_buffers() for bucket in buffer.buckets]

    @contextmanager
    def no_sync(self):
        """Accumulate grads locally (no reduction) for the microbatches inside the context."""
        for bucket in self._all_buckets():
            bucket.is_last_microbatch = False
        try:
            yield
        finally:
            for bucket in self._all_buckets():
                bucket.is_last_microbatch = True

    def start_grad_sync(self):
        """Launch every bucket's reduction that a grad hook has not launched yet."""
        for bucket in self._all_buckets():
            if not bucket.grad_reduce_started:
                bucket.start_grad_sync()

    def finish_grad_sync(self):
        """Wait until every bucket's grads are reduced (launching any still pending)."""
        for bucket in self._all_buckets():
            bucket.finish_grad_sync()
        for buffer in self._all_buffers():
            if buffer.copy_engine is not None:
                buffer.copy_engine.fence()  # no peer still reads the grads zero_grad_buffer clears

    def start_param_sync(self, *unused, force_sync: bool = False):
        """Distributed optimizer: all-gather every rank's updated param slices. The optimizer
        calls it at the end of each step that updated the params.

        Without overlap_param_gather (or with force_sync) every bucket is gathered and waited
        for now. With it, every bucket's all-gather is launched now, in forward order, and
        waited for by the forward pre-hook of the first module using its params (or by
        `finish_param_sync`): the gathers run while the host finishes the step and starts the
        next one.
        """
        if not self.ddp_config.use_distributed_optimizer:
            return
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        for bucket in self._buckets_in_forward_order:
            bucket.start_param_sync(async_op=async_op)

    def finish_param_sync(self):
        """Make every param current: wait for the all-gathers overlap_param_gather left in
        flight (a checkpoint reads the params outside the forward)."""
        for bucket in self._buckets_in_forward_order:
            bucket.finish_param_sync()

    def zero_grad_buffer(self):
        """Zero every main_grad and reset the reduction state; call before each iteration."""
        for param in self.param_to_bucket:
            param.grad = None
            param.grad_added_to_main_grad = False
        for buffer in self._all_buffers():
            buffer.reset()

    def scale_gradients(self, scaling_factor: float):
        for buffer in self._all_buffers():
            buffer.scale_gradients(scaling_factor)

    def broadcast_params(self):
        """Copy data-parallel rank 0's params to every replica."""
        for param in self.module.parameters():
            group = self.expt_dp_group if _is_expert_param(param) else self.dp_cp_group
            if get_pg_size(group) > 1:
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        # Copies in place: params and grads must stay views into the buffers.
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, *args, **kwargs):
        return self.module.sharded_state_dict(*args, **kwargs)
