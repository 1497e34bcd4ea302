"""Activation memory of one micro-batch on one rank, counted tensor by tensor.

Megatron's activation-memory formula (Korthikanti et al. 2022, sbh(34 + 5as/h) per layer)
describes Megatron's kernels; this module counts what teratron's layers actually keep for
backward (autograd's saved tensors, a view keeping its whole base alive), so a test can compare
it with the bytes `saved_tensors_hooks` sees on CPU. Notation: s = seq_length / cp (this rank's
sequence), b = micro-batch, T = s * b tokens, Tn = T / tp under sequence parallelism (else T),
a = activation bytes (params dtype), r = residual bytes (fp32 with fp32_residual_connection),
q = heads * kv_channels, kv = query_groups * kv_channels, f = ffn_hidden_size, g = 2 for a
gated (SwiGLU) MLP. Per transformer layer without recompute:

  norms      2 x RMSNorm/LayerNorm of [Tn, h]        (see kernels.py for what each keeps)
  attention  a T h                                   linear_qkv input (gathered under SP)
             a T (q + 2 kv) / tp                     fused QKV output (v is a view of it)
             a T (q + kv) / tp                       q, k after RoPE (or qk-norm / a GQA copy)
             4 a T rot                               cos/sin tables of RoPE for q and k
             a T q / tp + 4 T np / tp                SDPA output (linear_proj keeps a view of
                                                     it) + logsumexp (flash: no s x s scores)
  mlp        a T h                                   linear_fc1 input (gathered under SP)
             a T f / tp * (g + 3 if gated else 2)    fc1 output, act(gate), up, their product
  dropout    2 x mask of [Tn, h] when hidden_dropout > 0

Under sequence parallelism only the norm and dropout terms shrink by tp: the column-parallel
layers keep their all-gathered input, as teratron's layers gather inside autograd.
"""

import math
from dataclasses import dataclass, field

from teratron.estimate.kernels import KernelProfile
from teratron.estimate.params import ModelShape
from teratron.transformer.enums import AttnBackend
from teratron.transformer.moe.moe_logging import moe_layer_pattern

# Gradients alive while backward runs through one layer: the gradient of its largest saved
# tensor and of the tensor it came from (e.g. d(fc1 output) and d(act)), so twice the largest.
BACKWARD_GRADIENT_FACTOR = 2

_REFERENCE_BACKENDS = (AttnBackend.unfused, AttnBackend.local)


@dataclass(frozen=True)
class Dims:
    s: int          # sequence length on this rank (seq_length / cp)
    b: int          # micro-batch size
    tp: int
    sp: bool
    a: int          # activation bytes
    r: int          # residual-stream bytes (norm inputs)

    @property
    def tokens(self) -> int:
        return self.s * self.b

    @property
    def norm_tokens(self) -> int:
        return self.tokens // self.tp if self.sp else self.tokens


@dataclass
class ChunkActivations:
    """Bytes one micro-batch keeps on one rank of one model chunk, and the transients on top."""

    layers: list = field(default_factory=list)  # per layer: {part: bytes}
    extra: dict = field(default_factory=dict)    # embedding / output / pipeline tensors
    forward_transient: int = 0                   # live only inside forward (the loss)
    backward_transient: int = 0                  # gradients + recomputed activations in backward

    @property
    def stored(self) -> int:
        return sum(sum(layer.values()) for layer in self.layers) + sum(self.extra.values())


def dims_for(config, shape: ModelShape, micro_batch_size: int) -> Dims:
    a = config.params_dtype.itemsize
    return Dims(s=shape.seq_length // config.context_parallel_size, b=micro_batch_size,
                tp=config.tensor_model_parallel_size, sp=config.sequence_parallel, a=a,
                r=4 if config.fp32_residual_connection else a)


def norm_bytes(config, kernels: KernelProfile, elements: int, rows: int, input_bytes: int,
               input_is_new: bool) -> int:
    """What one norm keeps; `input_is_new` when nothing else keeps its input alive."""
    kept_input = input_bytes * elements if input_is_new else 0
    if config.normalization == "LayerNorm":
        return kept_input + 2 * kernels.layer_norm_stat_bytes * rows  # input, mean and 1/std per row
    if kernels.fused_rms_norm:
        return kept_input + 4 * rows
    # Composite: an fp32 upcast of the input (the input itself when already fp32) and the fp32
    # normalised value before the weight, plus 1/rms per row.
    upcast = 4 * elements if (input_bytes != 4 or input_is_new) else 0
    return upcast + 4 * elements + 4 * rows


def _mlp_bytes(config, tokens: int, ffn: int, tp: int, a: int) -> dict:
    fc1 = ffn // tp * (2 if config.gated_linear_unit else 1)
    # Gated: fc1 output (kept whole through the gate view), act(gate), up + offset, product.
    kept = fc1 + 3 * (ffn // tp) if config.gated_linear_unit else fc1 + ffn // tp
    return {"fc1 input": a * tokens * config.hidden_size, "mlp intermediates": a * tokens * kept}


def _attention_bytes(config, kernels, d: Dims, rope_dim: int, recompute_core: bool) -> dict:
    hn, T, a = config.kv_channels, d.tokens, d.a
    heads, groups = config.num_attention_heads // d.tp, config.num_query_groups // d.tp
    q, kv = heads * hn, groups * hn
    # Gathering a rank's query heads of several groups out of the interleaved QKV output copies.
    query_copy = heads != groups and groups > 1
    parts = {"qkv input": a * T * config.hidden_size, "qkv output": a * T * (q + 2 * kv)}
    # q and k are fresh tensors after RoPE or qk-norm (and q after that copy); otherwise SDPA
    # keeps views of the QKV output, already counted.
    new_q = rope_dim > 0 or config.qk_layernorm or query_copy
    new_k = rope_dim > 0 or config.qk_layernorm
    parts["q, k"] = a * T * (q * new_q + kv * new_k)
    if config.qk_layernorm:
        parts["qk norms"] = (norm_bytes(config, kernels, T * q, T * heads, a, query_copy)
                             + norm_bytes(config, kernels, T * kv, T * groups, a, False))
    if rope_dim:
        parts["rope tables"] = 4 * a * T * rope_dim  # cos and sin, for q and for k
    # SDPA's output, which linear_proj also keeps (as a view), and flash's fp32 logsumexp.
    parts["core attention"] = a * T * q + (0 if recompute_core else 4 * T * heads)
    return parts


def _moe_bytes(config, d: Dims) -> dict:
    """MoE layer under balanced routing: every rank's experts get k tokens per local token."""
    h, a, k, experts = config.hidden_size, d.a, config.moe_router_topk, config.num_moe_experts
    etp = config.expert_tensor_parallel_size
    local_tokens = d.tokens // d.tp if d.tp > 1 else d.tokens  # scattered over TP when not SP
    expert_tokens = local_tokens * k * etp
    # Router, per token: logits and scores [E] (activation dtype), the top-k softmax (fp32) and
    # indices (int64), the boolean routing map.
    router = d.norm_tokens * (2 * a * experts + 12 * k + experts)
    if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type != "none":
        # fp32 scores of every expert per token, the int64 token count per expert, the loss.
        router += d.norm_tokens * 4 * experts + 8 * experts + 4
    # The expert output (kept by the probability product) and the product (kept by the
    # unpermuting index_add), the probability, the permutation indices (GroupedMLP with biases
    # also the bias-row indices of both layers).
    indices = 3 if config.moe_grouped_gemm and config.add_bias_linear else 1
    parts = {"moe input": a * d.norm_tokens * h, "router": router,
             "expert input": a * expert_tokens * h,
             "expert intermediates": _mlp_bytes(config, expert_tokens, config.moe_ffn_hidden_size, etp,
                                                a)["mlp intermediates"],
             "expert output": expert_tokens * (2 * a * h + a + 8 * indices)}
    if config.moe_shared_expert_intermediate_size is not None:
        shared = _mlp_bytes(config, d.tokens, config.moe_shared_expert_intermediate_size, d.tp, a)
        # Without SP the shared expert's fc1 input is the MoE input itself.
        parts["shared expert"] = shared["mlp intermediates"] + (shared["fc1 input"] if d.sp else 0)
    return parts


def _selective(config) -> set:
    return set(config.recompute_modules or []) if config.recompute_granularity == "selective" else set()


def layer_bytes(config, kernels: KernelProfile, d: Dims, rope_dim: int, is_moe: bool,
                input_is_new: bool = True) -> dict:
    """{part: bytes} one transformer layer keeps (no full recompute). `input_is_new`: nothing
    else (the pipeline schedule) already holds the layer's input."""
    selective = _selective(config)
    h, Tn = config.hidden_size, d.norm_tokens
    parts = {}
    if "layernorm" in selective:  # the checkpoints keep only each norm's input
        parts["norms"] = d.r * Tn * h * (int(input_is_new) + 1)
    else:
        parts["norms"] = (norm_bytes(config, kernels, Tn * h, Tn, d.r, input_is_new)
                          + norm_bytes(config, kernels, Tn * h, Tn, d.r, True))
    parts.update(_attention_bytes(config, kernels, d, rope_dim, "core_attn" in selective))
    if ("moe" if is_moe else "mlp") in selective:
        parts["mlp checkpoint input"] = d.a * Tn * h
    elif is_moe:
        parts.update(_moe_bytes(config, d))
    else:
        parts.update(_mlp_bytes(config, d.tokens, config.ffn_hidden_size, d.tp, d.a))
    if config.hidden_dropout > 0:
        parts["dropout masks"] = 2 * kernels.dropout_bytes_per_element(d.a) * Tn * h
    return parts


def _keeps_layer_input(config, kernels: KernelProfile) -> bool:
    return (config.recompute_granularity == "full" or "layernorm" in _selective(config)
            or config.normalization == "LayerNorm" or kernels.fused_rms_norm)


def rope_dim_for(config, shape: ModelShape) -> int:
    if shape.position_embedding_type != "rope":
        return 0
    return int(config.kv_channels * shape.rotary_percent)


def chunk_activations(config, kernels: KernelProfile, shape: ModelShape, micro_batch_size: int,
                      layer_numbers: list, pre_process: bool, post_process: bool) -> ChunkActivations:
    """Activation bytes of one micro-batch through one model chunk on one rank."""
    if config.attention_backend in _REFERENCE_BACKENDS:
        raise ValueError(f"attention_backend={config.attention_backend.name}: the estimate models SDPA "
                         "attention (auto/flash/fused); the reference path keeps s x s scores")
    d = dims_for(config, shape, micro_batch_size)
    h, Tn, rope = config.hidden_size, d.norm_tokens, rope_dim_for(config, shape)
    pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq) if config.num_moe_experts else None
    result = ChunkActivations()
    hidden = d.r * Tn * h  # one [Tn, h] tensor of the residual stream
    if pre_process:
        # int64 token (and position) ids; under TP also the bool mask of ids outside the shard.
        ids = 2 if shape.position_embedding_type == "learned_absolute" else 1
        result.extra["embedding"] = 8 * d.tokens * ids + (d.tokens if d.tp > 1 else 0)
        if config.hidden_dropout > 0:
            result.extra["embedding"] += kernels.dropout_bytes_per_element(d.a) * Tn * h
        elif d.sp and d.tp > 1 and _keeps_layer_input(config, kernels):
            # The first layer's input is a view of the whole embedding output before the
            # sequence scatter; keeping it keeps all s tokens.
            result.extra["embedding"] += d.r * (d.tokens - Tn) * h
    else:
        result.extra["stage input"] = hidden
    if not post_process and not config.deallocate_pipeline_outputs:
        result.extra["stage output"] = hidden

    layers = [layer_bytes(config, kernels, d, rope, bool(pattern and pattern[n - 1]),
                          input_is_new=pre_process or i > 0)
              for i, n in enumerate(layer_numbers)]
    if layers:
        result.backward_transient = BACKWARD_GRADIENT_FACTOR * _largest_tensor(config, d, pattern)
    if config.recompute_granularity == "full":
        layers = _full_recompute(config, result, layers, hidden, pre_process, rope, d)
    result.layers = layers

    if post_process:
        logits = d.tokens * shape.padded_vocab_size // d.tp
        result.extra["output"] = (norm_bytes(config, kernels, Tn * h, Tn, d.r, True)
                                  + d.a * d.tokens * h        # output layer input (gathered)
                                  + 4 * logits + 9 * d.tokens)  # fp32 softmax, target, mask
        # Inside the loss's forward: the logits, their fp32 copy and the shifted logits (the
        # exponentials become the kept softmax); in backward the softmax's gradient copy.
        result.forward_transient = (d.a + (4 if d.a != 4 else 0) + 4) * logits
        result.backward_transient = max(result.backward_transient, 4 * logits)
    return result


def _largest_tensor(config, d: Dims, pattern) -> int:
    """Bytes of the biggest activation of a layer: the fc1 output, the QKV output or [T, h]."""
    gate = 2 if config.gated_linear_unit else 1
    hn = config.kv_channels
    sizes = [d.tokens * config.hidden_size,
             d.tokens * (config.num_attention_heads + 2 * config.num_query_groups) * hn // d.tp,
             d.tokens * gate * config.ffn_hidden_size // d.tp]
    if pattern and any(pattern):
        etp = config.expert_tensor_parallel_size
        local_tokens = d.tokens // d.tp if d.tp > 1 else d.tokens
        expert_tokens = local_tokens * config.moe_router_topk * etp
        sizes.append(expert_tokens * gate * config.moe_ffn_hidden_size // etp)
    return d.a * max(sizes)


def _full_recompute(config, result, layers, hidden, pre_process, rope, d) -> list:
    """Full recompute keeps each checkpoint's input; backward re-creates one checkpoint's layers."""
    n, per = len(layers), config.recompute_num_layers
    if config.recompute_method == "uniform":
        checkpoints, recomputed = math.ceil(n / per), min(per, n)
        kept = []
    else:  # block: the first `per` layers one by one, the rest as usual
        checkpoints, recomputed = min(per, n), 1 if n else 0
        kept = layers[checkpoints:]
    inputs = checkpoints - (0 if pre_process else 1)  # a later stage's input is already held
    full = {"checkpoint inputs": hidden * max(inputs, 0)}
    if rope and checkpoints:
        full["checkpoint inputs"] += 4 * d.tokens * rope  # the fp32 RoPE angles, shared
    result.backward_transient += sum(sum(layer.values()) for layer in layers[:recomputed])
    return [full] + kept
