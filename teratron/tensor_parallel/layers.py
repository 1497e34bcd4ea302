"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, DuplicatedLinear (replicated
over TP), VocabParallelEmbedding.

Initialisation is LAYOUT-INVARIANT (a project decision, see docs/design.md): with
`config.perform_initialization`, each layer builds the FULL fp32 master weight on the
parameter's device, applies `init_method` to it and keeps only its own shard
(`utils.shard_tensor`). Every TP rank draws the same numbers from the default generator, so
the same seed gives the same full model under any TP size, and a TP=2 run equals a TP=1 run
without copying weights. Biases start at zero.

Sharded parameters carry Megatron's attributes `tensor_model_parallel`, `partition_dim` and
`partition_stride`: the parts of the partitioned dim, each split over TP separately (an int for
equal parts, SwiGLU's [gate; up] is 2; a tuple of global part sizes for unequal ones, Mamba's
in_proj [z; x; B; C; dt]; `utils.partition_parts`); the bias of a row layer under sequence parallelism carries
`sequence_parallel=True` (its gradient is summed over TP by finalize_model_grads); expert
parameters carry `allreduce=False` (they are reduced over the expert-data-parallel group
instead, also with EP = 1: when expert-TP differs from TP the dense data-parallel group would
sum different expert-TP shards).

A layer built without a group takes the current topology's (expert-)TP group, as Megatron's
does. A layer whose TP group has one rank (or none: a group of one) never communicates,
whatever topology is current later. Expert layers
(`is_expert=True`) communicate nothing: the MoE token dispatcher moves tokens in
and out of the expert-TP region, as in Megatron.

`enable_fp8(recipe, name, cp_group)` switches a layer's GEMM to FP8 (`teratron.fp8`;
TransformerBlock calls it for the layers `config.fp8` covers, with its context-parallel group:
activations and their gradients are sequence shards there); the parameters stay in the params
dtype.

With `config.gradient_accumulation_fusion` a layer's own weight gets its gradient added straight
into `main_grad` by the weight-gradient GEMM (grad_accumulation_fusion.py), once DDP has given it
one; not for FP8 layers, nor for a weight passed to forward (a tied output layer).
"""

import torch
import torch.nn.functional as F
from torch import nn

from teratron.fp8.linear import Fp8Gemm
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel.batch_invariant import batch_invariant_linear
from teratron.tensor_parallel.grad_accumulation_fusion import fuses_grad_accumulation, linear_with_grad_accumulation
from teratron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from teratron.tensor_parallel.utils import VocabUtility, gather_shards, is_strided, resolve_tp_group, shard_tensor

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def param_is_not_tensor_parallel_duplicate(param, tp_group=None) -> bool:
    """True for a TP shard, or for a replicated parameter on TP rank 0 (count it once).
    `tp_group=None`: the current topology's."""
    return getattr(param, "tensor_model_parallel", False) or get_pg_rank(resolve_tp_group(tp_group)) == 0


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride) -> None:
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor) -> None:
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination, source) -> None:
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_device(config) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _init_weight(weight, full_shape, partition_dim, stride, init_method, rank, world_size,
                 keep_master_weight):
    """Initialise the full fp32 weight, copy this rank's shard into `weight`; returns the full
    weight if asked to keep it."""
    master = torch.empty(full_shape, dtype=torch.float32, device=weight.device)
    init_method(master)
    with torch.no_grad():
        weight.copy_(shard_tensor(master, partition_dim, stride, rank, world_size))
    return master if keep_master_weight else None


def padded_vocab_init_method(init_method, unpadded_vocab_size: int | None):
    """An init method for a full vocab-sized weight [padded_vocab, h] whose first
    `unpadded_vocab_size` rows are drawn exactly as `init_method` draws an unpadded [vocab, h]
    weight, and whose padding rows are zero (padding is not a token: see docs/design.md "Model").
    `None` means no padding: `init_method` itself."""
    if unpadded_vocab_size is None:
        return init_method

    def init(weight):
        assert unpadded_vocab_size <= weight.shape[0], "more real rows than the padded weight holds"
        real = torch.empty(unpadded_vocab_size, *weight.shape[1:], dtype=weight.dtype, device=weight.device)
        init_method(real)
        with torch.no_grad():
            weight.zero_()
            weight[:unpadded_vocab_size].copy_(real)
    return init


def _per_partition(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel size {tp_size}; "
                         f"choose a {what} that splits evenly")
    return size // tp_size


def _zero_bias(size, config, device):
    return nn.Parameter(torch.zeros(size, dtype=config.params_dtype, device=device))


def _fuse_grad_accumulation(weight, config) -> None:
    """Mark a layer's own weight for gradient-accumulation fusion (grad_accumulation_fusion.py)."""
    if weight is not None and config.gradient_accumulation_fusion:
        weight.fuse_wgrad_accumulation = True


def _matmul(fp8, input_, weight, bias=None, batch_invariant=False):
    """input_ @ weight^T (+ bias): F.linear; the layer's FP8 GEMM once enabled; with
    gradient-accumulation fusion, once DDP gave the weight a main_grad, the GEMM whose weight
    gradient adds into it; with `batch_invariant` that GEMM in fixed-shape row tiles."""
    if fp8 is not None:
        return fp8(input_, weight, bias)
    gemm = linear_with_grad_accumulation if fuses_grad_accumulation(weight) else F.linear
    if batch_invariant:
        return batch_invariant_linear(gemm, input_, weight, bias)
    return gemm(input_, weight, bias)


def _batch_invariant(config) -> bool:
    """TransformerConfig.batch_invariant_mode; a layer built from a ModelParallelConfig has none."""
    return getattr(config, "batch_invariant_mode", False)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (the output dim) over TP: [out/tp, in] per rank.

    Input [s, b, in] (or [s/tp, b, in] under sequence parallelism, all-gathered along dim 0);
    output [s, b, out/tp], or [s, b, out] with gather_output. forward returns
    (output, bias) where bias is None unless skip_bias_add (then the caller adds it). `stride`:
    the output's parts, each split over TP (an int of equal parts, or a tuple of their sizes).
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = True,
                 gather_output: bool = False, stride=1, keep_master_weight_for_test: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 is_expert: bool = False, tp_group=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.stride = stride
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.config = config
        self.tp_group = resolve_tp_group(tp_group, is_expert)
        self.tp_size, self.tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        self.output_size_per_partition = _per_partition(output_size, self.tp_size, "output_size")
        self.sequence_parallel = config.sequence_parallel and not is_expert
        allreduce = not is_expert
        device = param_device(config)
        self.fp8 = None

        self.master_weight = None
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                                   dtype=config.params_dtype, device=device))
            if config.perform_initialization:
                self.master_weight = _init_weight(
                    self.weight, (output_size, input_size), 0, stride, init_method,
                    self.tp_rank, self.tp_size, keep_master_weight_for_test)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
            self.weight.allreduce = allreduce
            _fuse_grad_accumulation(self.weight, config)
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, config, device)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            self.bias.allreduce = allreduce
        else:
            self.register_parameter("bias", None)

    def enable_fp8(self, recipe, name: str, cp_group=None) -> None:
        if self.weight is not None:  # the FP8 GEMM returns dW itself
            self.weight.fuse_wgrad_accumulation = False
        # The weight shard and the output gradient [s, b, out/tp] differ across TP ranks; the
        # input is whole over TP (replicated, or all-gathered under sequence parallelism). Both
        # activations are sequence shards over CP.
        self.fp8 = Fp8Gemm(recipe, self.input_size, self.output_size_per_partition, name=name,
                           input_groups=(cp_group,), weight_groups=(self.tp_group,),
                           grad_output_groups=(self.tp_group, cp_group), device=param_device(self.config))

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError("ColumnParallelLinear was built with skip_weight_param_allocation=True; "
                                   "pass weight= to forward")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(f"supplied weight has shape {tuple(weight.shape)}, expected "
                               f"{(self.output_size_per_partition, self.input_size)}")
        if self.is_expert or self.tp_size == 1:
            input_parallel = input_
        elif self.sequence_parallel:
            input_parallel = gather_from_sequence_parallel_region(input_, True, self.tp_group)
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        output = _matmul(self.fp8, input_parallel, weight, bias, batch_invariant=_batch_invariant(self.config))
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and not self.is_expert and self.tp_size > 1:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
            if is_strided(self.stride):  # rank blocks [r0: a0 b0 | r1: a1 b1] -> full order [a0 a1 b0 b1]
                output = gather_shards(output.chunk(self.tp_size, dim=-1), -1, self.stride)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (the input dim) over TP: [out, in/tp] per rank.

    Input [s, b, in/tp] when input_is_parallel (else [s, b, in], scattered along the last dim);
    the partial products are all-reduced to [s, b, out], or reduce-scattered to [s/tp, b, out]
    under sequence parallelism. The bias is added after the reduction (or returned when
    skip_bias_add).
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False, tp_group=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.config = config
        self.tp_group = resolve_tp_group(tp_group, is_expert)
        self.tp_size, self.tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        self.input_size_per_partition = _per_partition(input_size, self.tp_size, "input_size")
        self.sequence_parallel = config.sequence_parallel and not is_expert
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel needs input_is_parallel=True")
        allreduce = not is_expert
        device = param_device(config)
        self.fp8 = None

        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=config.params_dtype, device=device))
        self.master_weight = None
        if config.perform_initialization:
            self.master_weight = _init_weight(
                self.weight, (output_size, input_size), 1, stride, init_method,
                self.tp_rank, self.tp_size, keep_master_weight_for_test)
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.weight.allreduce = allreduce
        _fuse_grad_accumulation(self.weight, config)
        if bias:
            self.bias = _zero_bias(output_size, config, device)
            self.bias.sequence_parallel = self.sequence_parallel
            self.bias.allreduce = allreduce
        else:
            self.register_parameter("bias", None)

    def enable_fp8(self, recipe, name: str, cp_group=None) -> None:
        self.weight.fuse_wgrad_accumulation = False  # the FP8 GEMM returns dW itself
        # The weight shard and the input [s, b, in/tp] differ across TP ranks; the output
        # gradient is whole over TP (the backward of the all-reduce / reduce-scatter). Both
        # activations are sequence shards over CP.
        self.fp8 = Fp8Gemm(recipe, self.input_size_per_partition, self.output_size, name=name,
                           input_groups=(self.tp_group, cp_group), weight_groups=(self.tp_group,),
                           grad_output_groups=(cp_group,), device=param_device(self.config))

    def forward(self, input_):
        if self.input_is_parallel or self.is_expert or self.tp_size == 1:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = _matmul(self.fp8, input_parallel, self.weight,
                                  batch_invariant=_batch_invariant(self.config))
        if self.is_expert or self.tp_size == 1:
            output = output_parallel
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None


class DuplicatedLinear(nn.Module):
    """Y = X A^T (+ b) with the whole A on every TP rank (Megatron's TELinear with
    parallel_mode='duplicated'); it never communicates.

    Each rank multiplies the input it has: under sequence parallelism its own [s/tp, b, in] slice
    of the sequence, so the weight gradients differ across TP ranks and carry
    `sequence_parallel=True` (finalize_model_grads sums them over TP, as for the norms); else the
    whole [s, b, in], the same on every rank, and the caller makes the output's gradient whole
    on every rank too (an up projection's own copy_to_tensor_model_parallel_region, or one of
    its own), so the weight gradients agree without a reduction. The parameters are not
    tensor-parallel: checkpoints hold one copy.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 skip_bias_add: bool = False, tp_group=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.is_expert = False
        self.config = config
        self.tp_group = resolve_tp_group(tp_group)
        self.sequence_parallel = config.sequence_parallel and get_pg_size(self.tp_group) > 1
        device = param_device(config)
        self.fp8 = None
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            _init_weight(self.weight, (output_size, input_size), 0, 1, init_method, 0, 1, False)
        _fuse_grad_accumulation(self.weight, config)
        self.bias = _zero_bias(output_size, config, device) if bias else None
        for param in self.parameters():
            param.sequence_parallel = self.sequence_parallel

    def enable_fp8(self, recipe, name: str, cp_group=None) -> None:
        self.weight.fuse_wgrad_accumulation = False  # the FP8 GEMM returns dW itself
        # Under sequence parallelism the input and the output gradient are each TP rank's own
        # slice, and under CP each CP rank's; the weight is the same on all ranks.
        activation_groups = (self.tp_group if self.sequence_parallel else None, cp_group)
        self.fp8 = Fp8Gemm(recipe, self.input_size, self.output_size, name=name,
                           input_groups=activation_groups, grad_output_groups=activation_groups,
                           device=param_device(self.config))

    def forward(self, input_):
        bias = None if self.skip_bias_add else self.bias
        output = _matmul(self.fp8, input_, self.weight, bias, batch_invariant=_batch_invariant(self.config))
        return output, (self.bias if self.skip_bias_add else None)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary over TP: [V/tp, h] per rank.

    Each rank looks up the ids in its vocab range, zeros the rest, and the partial results are
    all-reduced: [b, s] ids -> [b, s, h]. With reduce_scatter_embeddings the output is
    transposed to [s, b, h] and reduce-scattered along the sequence to [s/tp, b, h].
    num_embeddings must be divisible by the TP size (see utils.pad_vocab_size).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method, config,
                 reduce_scatter_embeddings: bool = False, tp_group=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size, self.tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        self.num_embeddings_per_partition = _per_partition(num_embeddings, self.tp_size, "num_embeddings")
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
            self.num_embeddings_per_partition, self.tp_rank, self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=config.params_dtype, device=param_device(config)))
        if config.perform_initialization:
            _init_weight(self.weight, (num_embeddings, embedding_dim), 0, 1, init_method,
                         self.tp_rank, self.tp_size, False)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, input_):
        if self.tp_size > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            output_parallel = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            output_parallel = F.embedding(input_, self.weight)
        if self.tp_size == 1:
            return output_parallel.transpose(0, 1).contiguous() if self.reduce_scatter_embeddings else output_parallel
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
