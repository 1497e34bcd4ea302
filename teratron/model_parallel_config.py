"""ModelParallelConfig: how the model is split over devices, and the training hooks layers read.

Field names, meanings and defaults are Megatron Core's (`megatron.core.model_parallel_config`).
Fields for features teratron does not have yet are accepted at their default; any other value
raises NotImplementedError naming the field (see `UNSUPPORTED` below), never silently ignored.
"""

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch


# Not built yet: field -> the feature it belongs to. A value other than the field's default raises
# NotImplementedError. Fields that only tune an unsupported feature are listed too, so setting
# them is never silently ignored.
UNSUPPORTED = {
    "pipeline_model_parallel_comm_backend": "a non-default pipeline p2p backend (ucc)",
    "max_seqlen_per_dp_cp_rank": "hybrid context parallelism",
    "hybrid_context_parallel": "hybrid context parallelism",
    "moe_extended_tp": "extended tensor parallelism for MoE",
    "mtp_grad_scale_func": "multi-token prediction",
    "num_microbatches_with_partial_activation_checkpoints": "partial activation checkpointing",
    "async_tensor_model_parallel_allreduce": "async TP all-reduce overlap",
    "use_te_rng_tracker": "Transformer Engine's RNG tracker",
    "tp_comm_overlap": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_bulk_wgrad": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_bulk_dgrad": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_overlap_ag": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_overlap_rs": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_overlap_rs_dgrad": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_split_ag": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_atomic_ag": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_split_rs": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_atomic_rs": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_overlap_disable_qkv": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_overlap_disable_fc1": "TP communication/GEMM overlap (userbuffers)",
    "tp_comm_bootstrap_backend": "TP communication/GEMM overlap (userbuffers)",
    "overlap_moe_expert_parallel_comm": "EP all-to-all overlap across microbatches",
    "delay_wgrad_compute": "delayed weight-gradient compute",
    "overlap_dispatch_backward_with_experts_wgrad": "delayed expert weight-gradient compute",
    "ep_overlap_early_attn_memory_release": "EP all-to-all overlap across microbatches",
    "use_ring_exchange_p2p": "the ring-exchange p2p kernel (custom PyTorch build)",
    "defer_embedding_wgrad_compute": "deferred embedding weight-gradient compute",
    "wgrad_deferral_limit": "deferred embedding weight-gradient compute",
    "overlap_p2p_comm_warmup_flush": "p2p overlap in pipeline warm-up and flush",
    "pipeline_model_parallel_split_rank": "encoder-decoder pipeline split",
    "cpu_offloading": "CPU activation/weight offloading",
    "cpu_offloading_num_layers": "CPU activation/weight offloading",
    "cpu_offloading_activations": "CPU activation/weight offloading",
    "cpu_offloading_weights": "CPU activation/weight offloading",
    "cpu_offloading_double_buffering": "CPU activation/weight offloading",
    "cpu_offloading_retain_pinned_cpu_buffers": "CPU activation/weight offloading",
}


def check_unsupported(config, unsupported: dict, also_allowed: Optional[dict] = None) -> None:
    """Raise NotImplementedError for the first field in `unsupported` set off its default.

    `also_allowed` maps a field to extra values (besides its default) that are supported.
    """
    also_allowed = also_allowed or {}
    fields = {f.name: f for f in dataclasses.fields(config)}
    for name, feature in unsupported.items():
        field = fields[name]
        if field.default_factory is dataclasses.MISSING:
            default = field.default
        else:
            default = field.default_factory()
        value = getattr(config, name)
        allowed = also_allowed.get(name, ())
        if value == default or any(value == v and type(value) is type(v) for v in allowed):
            continue
        raise NotImplementedError(
            f"{name}={value!r}: {feature} is not supported yet; leave it at {default!r}"
        )


def _check_positive(config, *names) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class ModelParallelConfig:
    """Parallel layout, precision and the training-loop hooks shared by every layer."""

    ###################
    # Model parallelism
    ###################
    tensor_model_parallel_size: int = 1
    """Tensor (intra-layer) parallel size: weights of each layer are split over this many ranks."""

    pipeline_model_parallel_comm_backend: Optional[Literal["nccl", "ucc"]] = None
    """Backend for pipeline p2p; None uses the default process group's backend."""

    pipeline_model_parallel_size: int = 1
    """Pipeline (inter-layer) parallel size: the layer stack is split into this many stages."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved 1F1B schedule (needs PP > 1)."""

    sequence_parallel: bool = False
    """Split norms, dropout and residuals along the sequence over the TP group.

    At tensor_model_parallel_size=1 it is turned off with a warning (as Megatron's launcher does).
    """

    context_parallel_size: int = 1
    """Context parallel size: the sequence is split over this many ranks inside attention."""

    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    """Group sizes of each level of hierarchical (a2a+p2p) context parallelism."""

    max_seqlen_per_dp_cp_rank: Optional[int] = None
    """Longest sub-sequence one DPxCP rank takes under hybrid context parallelism."""

    hybrid_context_parallel: bool = False
    """Balance packed variable-length samples over CP ranks."""

    expert_model_parallel_size: int = 1
    """Expert parallel size: MoE experts are distributed over this many ranks."""

    expert_tensor_parallel_size: Optional[int] = None
    """Tensor parallel size inside each expert; None means tensor_model_parallel_size."""

    moe_extended_tp: bool = False
    """Legacy: shard experts over the TP group as well as the EP group."""

    ###################
    # Initialization
    ###################
    perform_initialization: bool = True
    """Initialise weights; turn off when they will be loaded from a checkpoint anyway."""

    use_cpu_initialization: bool = False
    """Initialise the full weights on CPU and copy shards to the device (layout-independent)."""

    ###################
    # Training
    ###################
    fp16: bool = False
    """Train with fp16 mixed precision (loss scaling)."""

    bf16: bool = False
    """Train with bf16 mixed precision."""

    params_dtype: torch.dtype = torch.float32
    """dtype the weights are created in."""

    timers: Optional[Callable] = None
    """Timers object (Megatron's `Timers` interface) used by schedules for timing."""

    finalize_model_grads_func: Optional[Callable] = None
    """Called after the last backward of a step: reduces grads over DP, tied embeddings, SP norms."""

    grad_scale_func: Optional[Callable] = None
    """Maps the loss to the scaled loss when loss scaling is on; None means no scaling."""

    mtp_grad_scale_func: Optional[Callable] = None
    """Loss scale for the multi-token-prediction loss."""

    no_sync_func: Optional[Callable] = None
    """Context manager that suppresses the DP gradient sync (all but the last microbatch)."""

    grad_sync_func: Optional[Callable] = None
    """Launches the asynchronous gradient reduction of the given parameters."""

    param_sync_func: Optional[Callable] = None
    """Launches the asynchronous parameter all-gather (distributed optimizer)."""

    deterministic_mode: bool = False
    """Choose deterministic kernels (slower; bit-reproducible runs)."""

    enable_autocast: bool = False
    """Run the forward step under torch.autocast."""

    autocast_dtype: Optional[torch.dtype] = None
    """dtype for torch.autocast; None means params_dtype."""

    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    """Microbatches in the pipeline window that checkpoint only some layers."""

    ###################
    # Optimizations
    ###################
    gradient_accumulation_fusion: bool = False
    """Weight-gradient GEMMs of the linear layers add straight into the fp32 `main_grad` (with
    DDP); see tensor_parallel/grad_accumulation_fusion.py."""

    async_tensor_model_parallel_allreduce: bool = False
    """Legacy: overlap the TP all-reduce of input grads with the weight-grad GEMM."""

    use_te_rng_tracker: bool = False
    """Use Transformer Engine's RNG tracker instead of ours."""

    tp_comm_overlap: bool = False
    """Overlap TP collectives with the GEMMs of the linear layers."""

    tp_comm_bulk_wgrad: bool = True
    """With tp_comm_overlap: overlap all-gather with the activation-gradient GEMM."""

    tp_comm_bulk_dgrad: bool = True
    """With tp_comm_overlap: overlap reduce-scatter with the weight-gradient GEMM."""

    tp_comm_overlap_ag: bool = True
    """With tp_comm_overlap: pipeline all-gather with the GEMM."""

    tp_comm_overlap_rs: bool = True
    """With tp_comm_overlap: pipeline reduce-scatter with the GEMM."""

    tp_comm_overlap_rs_dgrad: bool = False
    """With tp_comm_overlap: pipeline reduce-scatter with the dgrad GEMM."""

    tp_comm_split_ag: bool = True
    """Deprecated: split all-gather overlap with the forward GEMM."""

    tp_comm_atomic_ag: bool = False
    """Deprecated: atomic all-gather overlap with the forward GEMM."""

    tp_comm_split_rs: bool = True
    """Deprecated: split reduce-scatter overlap with the forward GEMM."""

    tp_comm_atomic_rs: bool = False
    """Deprecated: atomic reduce-scatter overlap with the forward GEMM."""

    cross_entropy_loss_fusion: bool = False
    """Fuse the output layer with the cross entropy: the loss is computed in token chunks and the
    full logits are never materialised (GPTModel then returns only the loss)."""

    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """Which fused cross entropy: 'native' (teratron's chunked one); Transformer Engine's 'te'
    is refused (teratron does not use Transformer Engine)."""

    tp_comm_overlap_disable_qkv: bool = False
    """With tp_comm_overlap: no all-gather overlap for the QKV GEMM."""

    tp_comm_overlap_disable_fc1: bool = False
    """With tp_comm_overlap: no all-gather overlap for the MLP fc1 GEMM."""

    tp_comm_bootstrap_backend: Literal["nccl", "mpi", "gloo"] = "nccl"
    """Backend that bootstraps the TP overlap buffers."""

    overlap_moe_expert_parallel_comm: bool = False
    """Overlap EP all-to-all with the compute of another microbatch."""

    delay_wgrad_compute: bool = False
    """Delay weight-gradient GEMMs to overlap batch-level communication."""

    overlap_dispatch_backward_with_experts_wgrad: bool = False
    """Compute expert weight gradients on a side stream, overlapping the dispatch backward."""

    ep_overlap_early_attn_memory_release: bool = False
    """With EP overlap: run attention backward earlier to free its activations sooner."""

    ###################
    # Pipeline Parallel
    ###################
    pipeline_dtype: Optional[torch.dtype] = None
    """dtype of activations sent between stages; None means params_dtype."""

    variable_seq_lengths: bool = False
    """Microbatches may differ in sequence length: p2p exchanges shapes first."""

    overlap_p2p_comm: bool = False
    """Overlap pipeline p2p with compute (needs batch_p2p_comm=False)."""

    batch_p2p_comm: bool = True
    """Send/receive with one batch_isend_irecv call instead of separate isend/irecv."""

    batch_p2p_sync: bool = True
    """Synchronise the device after batched p2p (works around old PyTorch bugs)."""

    use_ring_exchange_p2p: bool = False
    """Use the ring_exchange kernel of a custom PyTorch build for p2p."""

    deallocate_pipeline_outputs: bool = False
    """Free a stage's output data once sent; only its autograd graph is kept."""

    defer_embedding_wgrad_compute: bool = False
    """Defer the output-embedding weight-gradient GEMMs to the pipeline flush."""

    wgrad_deferral_limit: int = 0
    """Microbatches whose embedding wgrad is deferred; 0 means all."""

    overlap_p2p_comm_warmup_flush: bool = False
    """Also overlap p2p in the warm-up and flush phases."""

    pipeline_model_parallel_split_rank: Optional[int] = None
    """Legacy encoder-decoder models: the rank where the decoder starts."""

    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Interleaved schedule: microbatches run back to back per virtual stage; None means PP size."""

    mtp_standalone: bool = False
    """Set from the pipeline layout: multi-token prediction sits in its own virtual stage."""

    ###################
    # CPU Offloading
    ###################
    cpu_offloading: bool = False
    """Offload activations (and/or weights) to CPU asynchronously."""

    cpu_offloading_num_layers: int = 0
    """Number of layers whose activations are offloaded."""

    cpu_offloading_activations: bool = True
    """With cpu_offloading: offload activations."""

    cpu_offloading_weights: bool = False
    """With cpu_offloading: offload weights."""

    cpu_offloading_double_buffering: bool = False
    """With cpu_offloading: double-buffer reloads across layers."""

    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    """With cpu_offloading: keep the pinned CPU buffers between iterations."""

    ###################
    # Timing
    ###################
    barrier_with_L1_time: bool = True
    """Put a barrier before level-1 timers (all ranks must call them)."""

    def _check_hierarchical_context_parallel(self):
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is None:
            return
        if (not isinstance(sizes, (list, tuple)) or not sizes
                or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes)):
            raise ValueError(f"hierarchical_context_parallel_sizes={sizes!r} must be a list of positive ints")
        product = 1
        for n in sizes:
            product *= n
        if product != self.context_parallel_size:
            raise ValueError(f"hierarchical_context_parallel_sizes={list(sizes)} multiply to {product}, not "
                             f"context_parallel_size={self.context_parallel_size}; make their product the CP size")
        self.hierarchical_context_parallel_sizes = list(sizes)

    def __post_init__(self):
        check_unsupported(self, UNSUPPORTED)
        if self.cross_entropy_fusion_impl != "native":
            raise ValueError(
                f"cross_entropy_fusion_impl={self.cross_entropy_fusion_impl!r} is not available: teratron has "
                f"no Transformer Engine; use 'native' (--cross-entropy-fusion-impl native)"
            )
        _check_positive(
            self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "expert_model_parallel_size", "context_parallel_size",
        )
        self._check_hierarchical_context_parallel()
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # Megatron's launcher does the same: SP splits over the TP group, a group of one is a no-op.
            warnings.warn("sequence_parallel needs tensor_model_parallel_size > 1; turning it off")
            self.sequence_parallel = False
        if self.virtual_pipeline_model_parallel_size is not None:
            _check_positive(self, "virtual_pipeline_model_parallel_size")
            if self.pipeline_model_parallel_size == 1:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} "
                    "needs pipeline_model_parallel_size > 1; set it to None or raise the PP size"
                )
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        _check_positive(self, "expert_tensor_parallel_size")
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are both True; choose one mixed-precision mode (--fp16 or --bf16)")
        if not isinstance(self.params_dtype, torch.dtype) or not self.params_dtype.is_floating_point:
            raise ValueError(f"params_dtype must be a floating torch.dtype, got {self.params_dtype!r}")
        if self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.overlap_p2p_comm and self.batch_p2p_comm:
            raise ValueError("overlap_p2p_comm needs batch_p2p_comm=False; set batch_p2p_comm=False")
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size
        _check_positive(self, "microbatch_group_size_per_vp_stage")
        if (self.expert_model_parallel_size > 1 and self.tensor_model_parallel_size > 1
                and not self.sequence_parallel):
            warnings.warn("expert parallelism with tensor parallelism should use sequence_parallel=True")
