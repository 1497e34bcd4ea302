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

Under context parallelism s is this rank's share. The exchanged types (p2p, all_gather) keep
what SDPA keeps (q, k, v, the output linear_proj shares, the log-sum-exp); a2a and a2a+p2p keep
their exchanged, sorted copies of q, k, v and their own output instead of q, k and the QKV output,
linear_proj the output exchanged back, and each micro-batch one token order and its inverse. The
exchange's buffers (the ring's keys and values in flight, the gathered keys and values, the a2a
send and receive buffers, fp32 merge and gradient accumulators) are transients,
`context_parallel_transients`.

The count is storage by storage (`Saved`), each with the modules that keep it, so fine-grained
activation offloading is exact: a storage of at least `min_offloaded_tensor_size` elements kept by
an offloaded module is copied to the host, and leaves the device when every module keeping it is
offloaded (the SDPA output, kept by core_attn and by attn_proj as a view, needs both).

A layer compiled by `--torch-compile` keeps what Inductor's partitioner chooses
(`layer_storages(compiled=True)`): norms and dropout are decomposed on every device (a norm keeps
its input and per-row statistics, dropout a bool mask); RoPE's cos/sin and SwiGLU's act(gate) and
up are recomputed in backward (the fp32 RoPE angles, one tensor for all layers, are kept
instead); so is the second norm's input, from the layer input and linear_proj's output, which is
kept in its place. Selective recompute's checkpoints break the graph and change nothing else.
An MoE layer's router and experts are counted as without compilation.

The last stage keeps the output layer's input and, with the unfused loss, the logits (the loss
recomputes the softmax in backward; its passes are compiled kernels on CUDA, eager elsewhere); with
`cross_entropy_loss_fusion` the int64 targets only, the logits living one chunk at a time
(`fused_loss_transients`).

A hybrid model's layer (--hybrid-layer-pattern) keeps its one norm and what its kind keeps
(`hybrid_layer_storages`): attention's, the MLP's or the MoE layer's storages as above, or a Mamba-2,
Gated Delta Product (an `M` layer with gdp_layers) or Gated DeltaNet mixer's as its Triton kernels keep
them (what a GPU runs; on the CPU the PyTorch reference scans keep far more and are not modelled).
Under context parallelism a mixer's convolution and scan run over whole sequences for the rank's share
of the heads (`_mixer_share`), keeping the exchanged inputs besides; the token order the exchanges share
counts once.

Each multi-token-prediction depth (on the last stage) keeps what its embedding lookup keeps
(the shifted int64 ids), enorm's and hnorm's storages (hnorm's input is the previous output,
which its output layer keeps), the [Tn, 2h] concatenation eh_proj keeps (gathered under SP), a
transformer layer, its final norm, an output layer pass like the main one and the shifted fp32
loss mask; under full recompute only the checkpoint's inputs (the embeddings, and under SP
h_{k-1}) and the output layer's.
"""

import math
from dataclasses import dataclass, field, replace

from teratron.estimate.kernels import KernelProfile
from teratron.estimate.params import ModelShape, hybrid_symbols, mtp_depth_layers
from teratron.models.hybrid import Symbols
from teratron.ssm.context_parallel import head_shares
from teratron.ssm.gated_delta_net import CHUNK_SIZE as GATED_DELTA_NET_CHUNK_SIZE
from teratron.ssm.gated_delta_product import CHUNK_SIZE as GATED_DELTA_PRODUCT_CHUNK_SIZE
from teratron.ssm.mamba_mixer import CHUNK_SIZE as MAMBA_CHUNK_SIZE
from teratron.ssm.mamba_mixer import D_CONV, mamba_num_heads
from teratron.tensor_parallel.fused_cross_entropy import default_chunk_size
from teratron.transformer.context_parallel import layer_cp_comm_type
from teratron.transformer.enums import AttnBackend
from teratron.transformer.moe.moe_logging import moe_layer_indices

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
    loss_backward_transient: int = 0             # the fused loss's backward, its weight gradient included
    host: int = 0                                # offloaded to host memory (activation offloading)

    @property
    def stored(self) -> int:
        return sum(sum(layer.values()) for layer in self.layers) + sum(self.extra.values())


class NotModelled(ValueError):
    """The run uses something the estimate does not model (a one-line error for `teratron estimate`)."""


def dims_for(config, shape: ModelShape, micro_batch_size: int) -> Dims:
    a = config.params_dtype.itemsize
    return Dims(s=shape.seq_length // config.context_parallel_size, b=micro_batch_size,
                tp=config.tensor_model_parallel_size, sp=config.sequence_parallel, a=a,
                r=4 if config.fp32_residual_connection else a)


OTHER = "other"  # a saver that is not an offloadable module


@dataclass(frozen=True)
class Saved:
    """One storage autograd keeps: the report part it belongs to, its bytes, the elements of each
    of its storages (several equal ones for SequentialMLP's experts), who saves it (offloadable
    module names, activation_offload.OFFLOAD_MODULES, or OTHER) and whether its bytes count here
    (not when another part already counts them, as the pipeline's hold on a stage input)."""

    part: str
    nbytes: int
    numel: int
    savers: frozenset = frozenset({OTHER})
    counted: bool = True


def _saved(part, nbytes, numel, *savers, counted=True) -> Saved:
    return Saved(part, nbytes, numel, frozenset(savers or (OTHER,)), counted)


def norm_storages(config, kernels: KernelProfile, part: str, elements: int, rows: int, input_bytes: int,
                  input_is_new: bool, saver: str = OTHER) -> list:
    """What one norm keeps; `input_is_new` when nothing else keeps its input alive."""
    kept = [_saved(part, input_bytes * elements, elements, saver, *([] if input_is_new else [OTHER]),
                   counted=input_is_new)]
    # Its weight (and a LayerNorm's bias) in the input's dtype: new tensors, kept, when cast from the
    # parameters' dtype (an fp32 input of 16-bit parameters) or zero-centred (1 + w).
    width, cast = elements // rows, input_bytes != config.params_dtype.itemsize
    layer_norm = config.normalization == "LayerNorm"
    gamma = [_saved(part, input_bytes * width, width, saver)] * (
        int(cast or config.layernorm_zero_centered_gamma) + int(cast and layer_norm))
    if layer_norm:  # input, mean and 1/std per row (fp32 on CUDA, the input's dtype on the CPU)
        stat_bytes = max(kernels.layer_norm_stat_bytes, input_bytes)
        return kept + gamma + 2 * [_saved(part, stat_bytes * rows, rows, saver)]
    if kernels.fused_rms_norm:
        return kept + gamma + [_saved(part, 4 * rows, rows, saver)]
    # Composite: an fp32 upcast of the input (the input itself when already fp32) and the fp32
    # normalised value before the weight, plus 1/rms per row.
    upcast = [_saved(part, 4 * elements, elements, saver)] if (input_bytes != 4 or input_is_new) else []
    return upcast + gamma + [_saved(part, 4 * elements, elements, saver), _saved(part, 4 * rows, rows, saver)]


def norm_bytes(config, kernels: KernelProfile, elements: int, rows: int, input_bytes: int,
               input_is_new: bool) -> int:
    storages = norm_storages(config, kernels, "norm", elements, rows, input_bytes, input_is_new)
    return sum(s.nbytes for s in storages if s.counted)


def _norm_keeps_input(config, kernels: KernelProfile, input_bytes: int) -> bool:
    """Whether a norm keeps its input tensor itself (a view keeps its base alive)."""
    return config.normalization == "LayerNorm" or kernels.fused_rms_norm or input_bytes == 4


def _mlp_storages(config, tokens: int, ffn: int, tp: int, a: int, savers=(OTHER,) * 3, pieces: int = 1,
                  parts=("fc1 input", "mlp intermediates")) -> list:
    """fc1 input and the intermediates; savers = (fc1, activation, fc2); `pieces` equal
    storages per tensor (one per expert of a SequentialMLP)."""
    fc1_saver, act_saver, fc2_saver = savers
    h, f = config.hidden_size, ffn // tp
    fc1 = f * (2 if config.gated_linear_unit else 1)
    each = tokens // pieces
    out = [_saved(parts[0], a * tokens * h, each * h, fc1_saver),
           _saved(parts[1], a * tokens * fc1, each * fc1, act_saver)]  # the activation's input
    if config.gated_linear_unit:  # act(gate) and up + offset for the product; the gate is a view
        out += 2 * [_saved(parts[1], a * tokens * f, each * f, act_saver)]
    return out + [_saved(parts[1], a * tokens * f, each * f, fc2_saver)]  # the activation's output


def _attention_storages(config, kernels, d: Dims, rope_dim: int, recompute_core: bool, a2a: int = 1) -> list:
    """`a2a` > 1: context parallelism exchanges heads for tokens in groups of that size
    (cp_comm_type a2a, a2a+p2p): core attention keeps its own sorted copies of q, k and v (key and
    value heads repeated up to the query heads when a2a does not divide them) and its output, and
    linear_proj the output exchanged back, instead of q, k, the QKV output and a shared output."""
    hn, T, a = config.kv_channels, d.tokens, d.a
    heads, groups = config.num_attention_heads // d.tp, config.num_query_groups // d.tp
    q, kv = heads * hn, groups * hn
    core = OTHER if recompute_core else "core_attn"  # the recompute checkpoint keeps q, k, v
    exchanged = a2a > 1 and not recompute_core
    # Gathering a rank's query heads of several groups out of the interleaved QKV output copies.
    query_copy = heads != groups and groups > 1
    # SDPA keeps v, a view of the QKV output (and q, k when they are views too); so does a qk-norm
    # that keeps its input.
    norm_keeps = config.qk_layernorm and _norm_keeps_input(config, kernels, a)
    qkv_savers = ([] if exchanged else [core]) + ([OTHER] if norm_keeps else [])
    out = [_saved("qkv input", a * T * config.hidden_size, T * config.hidden_size, "qkv_linear")]
    if qkv_savers:
        out.append(_saved("qkv output", a * T * (q + 2 * kv), T * (q + 2 * kv), *qkv_savers))
    # q and k are fresh tensors after RoPE or qk-norm (and q after that copy).
    if not exchanged and (rope_dim > 0 or config.qk_layernorm or query_copy):
        out.append(_saved("q, k", a * T * q, T * q, core))
    if not exchanged and (rope_dim > 0 or config.qk_layernorm):
        out.append(_saved("q, k", a * T * kv, T * kv, core))
    if config.qk_layernorm:
        out += (norm_storages(config, kernels, "qk norms", T * q, T * heads, a, query_copy)
                + norm_storages(config, kernels, "qk norms", T * kv, T * groups, a, False))
    if rope_dim:
        out.append(_saved("rope tables", 4 * a * T * rope_dim, T * rope_dim))  # cos and sin, for q and k
    if exchanged:
        kv_heads = groups if groups % a2a == 0 else heads
        out += [_saved("q, k", a * T * q, T * q, core)] + 2 * [_saved("q, k", a * T * kv_heads * hn,
                                                                     T * kv_heads * hn, core)]
        out += [_saved("core attention", a * T * q, T * q, core), _saved("core attention", 4 * T * heads, T * heads, core),
                _saved("core attention", a * T * q, T * q, "attn_proj")]
        return out
    # SDPA's output, which linear_proj also keeps (as a view), and flash's fp32 logsumexp.
    out_savers = ["attn_proj"] + ([] if recompute_core else ["core_attn"])
    out.append(_saved("core attention", a * T * q, T * q, *out_savers))
    if not recompute_core:
        out.append(_saved("core attention", 4 * T * heads, T * heads, "core_attn"))
    return out


def _mla_attention_storages(config, kernels, d: Dims, rope_dim: int, recompute_core: bool,
                            recompute_up: bool) -> list:
    """Multi-latent attention (n = heads / tp, d_c kv_lora_rank, d_q q_lora_rank, q_head = d_n + d_r):
    the down projections' input [Tn, h]; the latent norms; the up projections' inputs [T, d_q] and
    [T, d_c] (gathered under SP; the kv one is a view of the down projection's [Tn, d_c + d_r]
    output where nothing copies it); RoPE's cos/sin; core attention's q, k [T, n q_head] and v
    [T, n d_v] (fresh tensors: the up projections' outputs are dropped), its output and
    logsumexp. 'mla_up_proj' keeps the up projections' (ungathered) inputs and the RoPE key
    instead of their outputs, q, k and v (freed until backward). Padded heads (the flash
    backend): core attention keeps padded copies of q, k, v and its padded output."""
    T, Tn, a, h = d.tokens, d.norm_tokens, d.a, config.hidden_size
    n = config.num_attention_heads // d.tp
    dn, dr, dv, dc = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim, config.kv_lora_rank
    q_head = dn + dr
    norms, keeps_input = config.qk_layernorm, _norm_keeps_input(config, kernels, a)
    out = [_saved("qkv input", a * Tn * h, Tn * h, "qkv_linear")]
    # Queries: the up projection's input, and the norm before it.
    if config.q_lora_rank is None:
        if d.sp and not recompute_up:  # linear_q_proj's gathered input (else the input above)
            out.append(_saved("latents", a * T * h, T * h, "qkv_linear"))
    else:
        dq = config.q_lora_rank
        if norms:
            out += norm_storages(config, kernels, "latent norms", Tn * dq, Tn, a, True, "qkv_linear")
        rows = Tn if recompute_up else T  # the checkpoint keeps the ungathered input
        out.append(_saved("latents", a * rows * dq, rows * dq, "qkv_linear"))
    # Keys and values: the down projection's output K [Tn, d_c + d_r] is kept whole by whoever keeps
    # a view of it: the kv norm (if it keeps its input), the kv up projection without the norm
    # (ungathered, i.e. without SP), the recompute checkpoint (c_kv without the norm, the RoPE key
    # without SP).
    if norms:
        kv_norm = norm_storages(config, kernels, "latent norms", Tn * dc, Tn, a, True, "qkv_linear")
        if keeps_input:
            kv_norm[0] = _saved("latent norms", a * Tn * (dc + dr), Tn * (dc + dr), "qkv_linear")
        out += kv_norm
    k_kept = (not d.sp and (not norms or recompute_up)) or (recompute_up and not norms)
    if k_kept and not (norms and keeps_input):
        out.append(_saved("latents", a * Tn * (dc + dr), Tn * (dc + dr), "qkv_linear"))
    if norms:  # the kv up projection's input: the norm's output (gathered under SP)
        rows = Tn if recompute_up else T
        out.append(_saved("latents", a * rows * dc, rows * dc, "qkv_linear"))
    elif d.sp and not recompute_up:
        out.append(_saved("latents", a * T * dc, T * dc, "qkv_linear"))
    if recompute_up and d.sp:
        out.append(_saved("latents", a * T * dr, T * dr, "qkv_linear"))  # the gathered RoPE key
    if rope_dim and not recompute_up:
        out.append(_saved("rope tables", 4 * a * T * rope_dim, T * rope_dim, "qkv_linear"))
    # Core attention.
    pad = config.attention_backend == AttnBackend.flash and q_head != dv
    head = max(q_head, dv) if pad else None
    core = OTHER if recompute_core else "core_attn"
    qkv = 3 * n * head if pad else 0 if recompute_up else n * (2 * q_head + dv)
    if qkv:
        out.append(_saved("q, k, v", a * T * qkv, T * qkv, core))
    if pad:  # SDPA keeps its padded output, linear_proj the unpadded copy
        if not recompute_core:
            out.append(_saved("core attention", a * T * n * head, T * n * head, "core_attn"))
        out.append(_saved("core attention", a * T * n * dv, T * n * dv, "attn_proj"))
    else:
        out_savers = ["attn_proj"] + ([] if recompute_core else ["core_attn"])
        out.append(_saved("core attention", a * T * n * dv, T * n * dv, *out_savers))
    if not recompute_core:
        out.append(_saved("core attention", 4 * T * n, T * n, "core_attn"))
    return out


def _moe_storages(config, d: Dims) -> list:
    """MoE layer under balanced routing: every rank's experts get k tokens per local token."""
    h, a, k, experts = config.hidden_size, d.a, config.moe_router_topk, config.num_moe_experts
    etp = config.expert_tensor_parallel_size
    local_tokens = d.tokens // d.tp if d.tp > 1 else d.tokens  # scattered over TP when not SP
    expert_tokens = local_tokens * k * etp
    # Router, per token: logits [E] (activation dtype), the top-k softmax (fp32) and indices (int64).
    # The permutation's masked_select, per token the all-gather dispatcher gathers over expert-TP
    # (local_tokens x etp): the local experts' transposed probabilities (activation dtype) and the
    # routing mask (bool), E / ep experts of ep x as many tokens.
    router = d.norm_tokens * (a * experts + 12 * k) + local_tokens * etp * experts * (a + 1)
    if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type != "none":
        # fp32 scores of every expert per token, the int64 token count per expert, the loss.
        router += d.norm_tokens * 4 * experts + 8 * experts + 4
    # The expert output (kept by the probability product) and the product (kept by the
    # unpermuting index_add), the probability, the permutation indices (GroupedMLP with biases
    # also the bias-row indices of both layers).
    indices = 3 if config.moe_grouped_gemm and config.add_bias_linear else 1
    pieces = 1 if config.moe_grouped_gemm else config.num_moe_experts // config.expert_model_parallel_size
    out = [_saved("moe input", a * d.norm_tokens * h, d.norm_tokens * h), _saved("router", router, 0)]
    out += _mlp_storages(config, expert_tokens, config.moe_ffn_hidden_size, etp, a,
                         savers=("expert_fc1", "moe_act", OTHER), pieces=pieces,
                         parts=("expert input", "expert intermediates"))
    out.append(_saved("expert output", expert_tokens * (2 * a * h + a + 8 * indices), 0))
    if config.moe_shared_expert_intermediate_size is not None:
        shared = _mlp_storages(config, d.tokens, config.moe_shared_expert_intermediate_size, d.tp, a,
                               parts=("shared expert", "shared expert"))
        # Without SP the shared expert's fc1 input is the MoE input itself.
        out += shared if d.sp else shared[1:]
    return out


def _mixer_share(config, d: Dims, symbol: str) -> tuple:
    """(sequence length, heads, groups, the convolution's channels, every channel read) of what a
    rank's Mamba ('M'; Gated Delta Product with gdp_layers) or Gated DeltaNet ('G': value heads and the
    key heads they read) mixer scans: its tensor-parallel rank's heads over its tokens, or under context
    parallelism its share (`teratron.ssm.context_parallel`) over whole sequences."""
    if symbol == Symbols.MAMBA:
        heads, groups = mamba_num_heads(config) // d.tp, config.mamba_num_groups // d.tp
    else:
        heads, groups = config.linear_num_value_heads // d.tp, config.linear_num_key_heads // d.tp
    s, cp = d.s, config.context_parallel_size
    if cp > 1:
        share = head_shares(heads, groups, cp, ("heads", "groups", "a recurrent mixer"))[0]
        s, heads, groups = cp * d.s, len(share.heads), len(share.groups)
    if symbol == Symbols.MAMBA and config.gdp_layers:
        m = config.gdp_num_householder
        conv = m * heads * config.mamba_head_dim + (m + 1) * groups * config.mamba_state_dim
        return s, heads, groups, conv, conv + (m + 1) * heads  # V_m K_m Q, b_m a
    if symbol == Symbols.MAMBA:
        conv = heads * config.mamba_head_dim + 2 * groups * config.mamba_state_dim
        return s, heads, groups, conv, conv + heads  # x B C, dt
    conv = 2 * groups * config.linear_key_head_dim + heads * config.linear_value_head_dim
    return s, heads, groups, conv, conv + 2 * heads  # q k v, b a


def _exchange_storages(config, d: Dims, symbol: str, part: str) -> list:
    """What a recurrent mixer's exchange under context parallelism keeps: the received inputs
    [b S, channels] (whole sequences; the convolution's input is a view of them), the int64 channel
    indices of every share's reads and of this share's convolution, and the share's copy of the
    convolution's weight (and Mamba-2's bias)."""
    s, _, _, conv, channels = _mixer_share(config, d, symbol)
    tokens, cp = s * d.b, config.context_parallel_size
    taps = D_CONV if symbol == Symbols.MAMBA else config.linear_conv_kernel_dim
    bias = int(symbol == Symbols.MAMBA and not config.gdp_layers)
    return [_saved(part, d.a * tokens * channels, tokens * channels),
            _saved(part, 8 * cp * channels, cp * channels), _saved(part, 8 * conv, conv),
            _saved(part, d.a * conv * (taps + bias), conv * taps)]


def _mamba_storages(config, d: Dims, compiled: bool) -> list:
    """A Mamba mixer on the scan kernels (heads, groups / tp; L its chunk, m = ceil(s / L) chunks):
    in_proj's input [T, h] (gathered under SP); the convolution's input, in_proj's whole output
    [T, z + xBC + dt] (xBC is a view of it); softplus's fp32 input [T, heads]; -exp(A_log) (exp's
    output and its negation); the scan's x, B and C (views of the convolution's output [T, xBC]),
    dt (fp32), the fp32 cum [b, heads, m L] and C B^T [b, m, groups, L, L], the entering states
    [b, m, heads, p, n] in the activations' dtype; the gated norm's y [T, d_inner] and fp32 1/rms [T, groups]; out_proj's
    input [T, d_inner] (a contiguous copy of the norm's [b, s] output). Compiled, Inductor keeps one
    of softplus's input and output and one of exp(A_log) and its negation, except that with fp32
    activations (no cast between in_proj's output and the gate's arithmetic) it keeps both of the
    former.

    Without context parallelism everything between the projections is one op (teratron.ssm.mamba_core),
    which keeps the same but no dt: its backward recomputes softplus and -exp(A_log) from in_proj's
    output and the parameters.

    Under context parallelism the convolution and the scan run over whole sequences (S = CP s
    tokens of each row) for the rank's share of the heads and groups; in_proj's output stays (the
    norm's gate z is a view of it), the exchanged [b S, xBC + dt] share its convolution reads and
    the share's copies of the convolution's weight and bias are kept besides."""
    a, T, h, tp = d.a, d.tokens, config.hidden_size, d.tp
    heads, groups = mamba_num_heads(config) // tp, config.mamba_num_groups // tp
    p, n = config.mamba_head_dim, config.mamba_state_dim
    d_inner, xbc = heads * p, heads * p + 2 * groups * n
    out = [_saved("mamba in_proj input", a * T * h, T * h),
           _saved("mamba in_proj output", a * T * (d_inner + xbc + heads), T * (d_inner + xbc + heads))]
    if config.context_parallel_size > 1:
        out += _exchange_storages(config, d, Symbols.MAMBA, "mamba exchange")
    # The convolution and the scan: Ts tokens, this rank's share of the heads and groups.
    s, share_heads, share_groups, share_xbc, _ = _mixer_share(config, d, Symbols.MAMBA)
    Ts, L = s * d.b, MAMBA_CHUNK_SIZE
    m = -(-s // L)
    if config.context_parallel_size > 1:  # the convolution, the scan and the norm as three ops
        out += [_saved("mamba dt", _gate_copies(compiled, a) * 4 * Ts * share_heads, Ts * share_heads),
                _saved("mamba dt", (1 if compiled else 2) * 4 * share_heads, share_heads)]
    return out + [
        _saved("mamba convolution output", a * Ts * share_xbc, Ts * share_xbc),
        _saved("mamba scan", 4 * d.b * share_heads * m * L, d.b * share_heads * m * L),
        _saved("mamba scan", 4 * d.b * m * share_groups * L * L, d.b * m * share_groups * L * L),
        _saved("mamba scan", a * d.b * m * share_heads * p * n, d.b * m * share_heads * p * n),
        _saved("mamba gated norm", a * T * d_inner + 4 * T * groups, T * d_inner),
        _saved("mamba out_proj input", a * T * d_inner, T * d_inner)]


def _gated_delta_net_storages(config, kernels: KernelProfile, d: Dims, compiled: bool) -> list:
    """A Gated DeltaNet on the rule's kernels (key heads nk, value heads nv / tp; qk = nk dk, v = nv
    dv; L its chunk, m chunks): in_proj's input [T, h] and whole output [T, q k v z b a] (the
    convolution's input; z, b and a are views of it); q's and k's L2 norms in fp32 (copies of the
    convolution's [T, qk] slices, or its output itself when fp32) with 1/norm and its scaled form
    [T, nk] each; g's exp(A_log), its negation, softplus's input and output (fp32); sigmoid(b)
    [T, nv]; the rule's q and k [T, nv dk] (each key head repeated for its value heads), v (a view of
    the convolution's output [T, 2 qk + v]), g, the fp32 cum [b, nv, m L] and solved systems
    [b, m, nv, L, L]; out_norm over each value head of the fp32 output (the model's norm), the fp32
    norm output, silu's fp32 input (z's copy with 16-bit activations) and output; out_proj's input
    [T, v] (a contiguous copy). Compiled, Inductor
    keeps the convolution's output, in_proj's, each of q and k's 1/norm [T, nk] (fp32) with the
    rule's repeated q and k, g (and with fp32 activations one more [T, nv] fp32 gate tensor),
    sigmoid(b), the rule's output o [T, v] and saved cum and systems, out_norm's statistics of o
    and out_proj's input: the norms and the gating are recomputed from them.

    Under context parallelism the convolution and the rule run over whole sequences (S = CP s
    tokens of each row) for the rank's share of the value heads and the key heads they read; the
    exchanged [b S, q k v b a] share its convolution reads and the share's copy of the convolution's
    weight are kept, in_proj's output only as z with fp32 activations or compiled (silu's input;
    16-bit eager ones keep z's fp32 copy); out_norm and the gating stay on the rank's tokens, in a
    compiled graph of their own (a LayerNorm keeps both its statistics)."""
    a, T, h, tp = d.a, d.tokens, config.hidden_size, d.tp
    nk, nv = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp
    dk, v = config.linear_key_head_dim, nv * config.linear_value_head_dim
    projected = 2 * nk * dk + 2 * v + 2 * nv
    out = [_saved("gdn in_proj input", a * T * h, T * h)]
    if config.context_parallel_size > 1:
        # in_proj's output stays only as silu's input z (16-bit activations: an fp32 copy instead)
        out += [_saved("gdn in_proj output", a * T * projected, T * projected)] * (a == 4 or compiled)
        out += _exchange_storages(config, d, Symbols.GDN, "gdn exchange")
    else:
        out.append(_saved("gdn in_proj output", a * T * projected, T * projected))
    # The convolution and the rule: Ts tokens, `heads` value heads reading `key_heads`.
    s, heads, key_heads, conv, _ = _mixer_share(config, d, Symbols.GDN)
    Ts, L = s * d.b, GATED_DELTA_NET_CHUNK_SIZE
    m = -(-s // L)
    out.append(_saved("gdn convolution output", a * Ts * conv, Ts * conv))
    rule = [_saved("gdn rule", 4 * d.b * heads * m * L, d.b * heads * m * L),
            _saved("gdn rule", 4 * d.b * m * heads * L * L, d.b * m * heads * L * L)]
    if compiled:
        # out_norm's fp32 statistics of o per row: 1/rms, or a LayerNorm's mean and 1/std (one of them
        # with fp32 activations, where Inductor keeps the extra gate tensor instead; not under CP,
        # whose exchange parts the gates' graph from the norm's)
        trade = a == 4 and config.context_parallel_size == 1
        stats = 2 if config.normalization == "LayerNorm" and not trade else 1
        return out + 2 * [_saved("gdn q, k norms", 4 * Ts * key_heads + a * Ts * heads * dk, Ts * heads * dk)] + [
            _saved("gdn gates", _gate_copies(compiled, a) * 4 * Ts * heads, Ts * heads),
            _saved("gdn gates", a * Ts * heads, Ts * heads), _saved("gdn rule", a * T * v, T * v)] + rule + [
            _saved("gdn out_norm", stats * 4 * T * nv, T * nv), _saved("gdn out_proj input", a * T * v, T * v)]
    fp32_copies = a != 4  # 16-bit activations: .float() copies (fp32 ones are the tensors themselves)
    if fp32_copies:
        out += 2 * [_saved("gdn q, k norms", 4 * Ts * key_heads * dk, Ts * key_heads * dk)]
    out += 4 * [_saved("gdn q, k norms", 4 * Ts * key_heads, Ts * key_heads)]
    out += [_saved("gdn gates", 2 * 4 * heads + 2 * 4 * Ts * heads, Ts * heads),
            _saved("gdn gates", a * Ts * heads, Ts * heads),
            _saved("gdn rule", 2 * a * Ts * heads * dk, Ts * heads * dk),
            _saved("gdn rule", 4 * Ts * heads, Ts * heads)]
    out += rule + norm_storages(config, kernels, "gdn out_norm", T * v, T * nv, 4, True)
    # out_norm and the gating, on the rank's tokens and all its heads
    out += (1 + fp32_copies) * [_saved("gdn gated output", 4 * T * v, T * v)]
    return out + [_saved("gdn gated output", 4 * T * v, T * v), _saved("gdn out_proj input", a * T * v, T * v)]


def _gated_delta_product_storages(config, d: Dims, compiled: bool) -> list:
    """A Gated Delta Product mixer on the rule's kernels (heads, groups / tp, head dim p, state n, M
    substeps a token): in_proj's input [T, h] and whole output [T, z V_m K_m Q b_m a] (the convolution's
    input; z, b and a are views of it); the convolution and the rule (`_gated_delta_product_rule_storages`);
    the gated norm's y, the rule's output at each token's last substep [T, heads p] (a copy), and its
    fp32 1/rms [T, groups]; out_proj's input [T, d_inner] (the norm's output).

    Under context parallelism the convolution and the rule run over whole sequences for the rank's
    share of the heads and groups; the exchanged [b S, V_m K_m Q b_m a] share its convolution reads
    and the share's copy of the convolution's weight are kept besides, and the gated norm keeps the
    output exchanged back [T, d_inner] (in_proj's output stays: z is a view of it)."""
    a, T, tp = d.a, d.tokens, d.tp
    m, p, n = config.gdp_num_householder, config.mamba_head_dim, config.mamba_state_dim
    heads, groups = mamba_num_heads(config) // tp, config.mamba_num_groups // tp
    d_inner, projected = heads * p, (m + 1) * (heads * p + groups * n + heads)
    out = [_saved("gdp in_proj input", a * T * config.hidden_size, T * config.hidden_size),
           _saved("gdp in_proj output", a * T * projected, T * projected)]
    if config.context_parallel_size > 1:
        out += _exchange_storages(config, d, Symbols.MAMBA, "gdp exchange")
    out += _gated_delta_product_rule_storages(config, d, compiled)
    y = T * d_inner  # the tokens' outputs (a copy of the rule's, or exchanged back)
    return out + [_saved("gdp gated norm", a * y + 4 * T * groups, y),
                  _saved("gdp out_proj input", a * T * d_inner, T * d_inner)]


def _gated_delta_product_rule_storages(config, d: Dims, compiled: bool) -> list:
    """What a Gated Delta Product's convolution and rule keep over Ts tokens and E = M Ts substeps
    (this rank's share of the heads and groups; L the rule's chunk, m = ceil(M s / L) chunks): the
    convolution's output [Ts, V_m K_m Q] where a view of it is kept (q's with fp32 activations, v's and
    k's with M = 1); q's and k's L2 norms in fp32: q's upcast [Ts, groups n], k's [E, groups n] (a copy:
    a token's M keys are not one stride apart in the convolution's output), each with 1/norm and its
    scaled form per group; g's exp(A_log), its negation, softplus's input and output (fp32); sigmoid(b)
    [E, heads]; the rule's q (zeros but at a token's last substep) and k [E, heads n] (each group's
    repeated for its heads), v [E, heads p] (a copy when M > 1), g (fp32, zeros but at a token's first
    substep), beta [E, heads] (when M > 1 and b > 1 a copy of sigmoid(b), whose [s, b] layout does not
    reshape to a token's substeps in a row), the fp32 cum [b, heads, m L] and solved systems
    [b, m, heads, L, L]. Compiled, Inductor keeps the convolution's output (for q), k's copy in the
    activations' dtype, one of each 1/norm pair, and of g's tensors only one [Ts, heads] with fp32
    activations (none with 16-bit ones): the rest is recomputed from them."""
    a, m, p, n = d.a, config.gdp_num_householder, config.mamba_head_dim, config.mamba_state_dim
    s, heads, groups, conv, _ = _mixer_share(config, d, Symbols.MAMBA)
    Ts, L = s * d.b, GATED_DELTA_PRODUCT_CHUNK_SIZE
    E, chunks = m * Ts, -(-m * s // L)
    upcast = a != 4 and not compiled  # eager 16-bit activations: q's and k's norms take fp32 copies
    out = [_saved("gdp convolution output", a * Ts * conv, Ts * conv)] * (compiled or a == 4 or m == 1)
    out += [_saved("gdp q, k norms", 4 * Ts * groups * n, Ts * groups * n)] * upcast
    out += [_saved("gdp q, k norms", (a if compiled else 4) * E * groups * n, E * groups * n)] * (m > 1 or upcast)
    out += (1 if compiled else 2) * [_saved("gdp q, k norms", 4 * Ts * groups, Ts * groups),
                                     _saved("gdp q, k norms", 4 * E * groups, E * groups)]
    if not compiled:
        out.append(_saved("gdp gates", 2 * 4 * heads + 2 * 4 * Ts * heads, Ts * heads))
    elif a == 4:
        out.append(_saved("gdp gates", 4 * Ts * heads, Ts * heads))
    substeps = E * heads
    beta_copy = a if m > 1 and d.b > 1 else 0
    return out + [
        _saved("gdp gates", a * substeps, substeps),  # sigmoid(b)
        _saved("gdp rule", a * substeps * (2 * n + (p if m > 1 else 0)), substeps * n),  # q, k (and v)
        _saved("gdp rule", (4 + beta_copy) * substeps, substeps),  # g (and beta)
        _saved("gdp rule", 4 * d.b * heads * chunks * L, d.b * heads * chunks * L),
        _saved("gdp rule", 4 * d.b * chunks * heads * L * L, d.b * chunks * heads * L * L)]


def _gate_copies(compiled: bool, a: int) -> int:
    """[T, heads] fp32 gate tensors a Mamba or Gated DeltaNet layer keeps besides its scan's (softplus's
    input and output; compiled, one, or both with fp32 activations)."""
    return 2 if not compiled or a == 4 else 1


def hybrid_layer_storages(config, kernels: KernelProfile, d: Dims, rope_dim: int, symbol: str,
                          input_is_new: bool = True, compiled: bool = False, a2a: int = 1) -> list:
    """The storages one hybrid layer keeps (no full recompute): its norm, then the half of a GPT
    layer `symbol` names (* attention, + multi-latent attention, - MLP, E MoE) or its recurrent mixer
    (M Mamba-2, or Gated Delta Product with gdp_layers; G Gated DeltaNet), and its dropout mask.
    Compiled: decomposed norms and dropout, RoPE's tables and SwiGLU's pieces recomputed as in a GPT
    layer. Selective recompute as in a GPT layer's halves (`layernorm`, `core_attn`, `mla_up_proj`, `mlp`,
    `moe`); an `M` layer recomputes nothing."""
    if compiled:
        kernels = replace(kernels, fused_rms_norm=True, fused_dropout=True)
    h, Tn = config.hidden_size, d.norm_tokens
    selective = _selective(config) if symbol != Symbols.MAMBA else set()
    if "layernorm" in selective:  # the checkpoint keeps only the norm's input
        out = [_saved("norms", d.r * Tn * h, Tn * h)] * int(input_is_new)
    else:
        out = norm_storages(config, kernels, "norms", Tn * h, Tn, d.r, input_is_new)
    if ({Symbols.MLP: "mlp", Symbols.MOE: "moe"}.get(symbol)) in selective:
        out.append(_saved("mlp checkpoint input", d.a * Tn * h, Tn * h))
    elif symbol == Symbols.ATTENTION:
        out += [s for s in _attention_storages(config, kernels, d, rope_dim, "core_attn" in selective, a2a)
                if not (compiled and s.part == "rope tables")]
    elif symbol == Symbols.MLA:
        out += [s for s in _mla_attention_storages(config, kernels, d, rope_dim, "core_attn" in selective,
                                                   "mla_up_proj" in selective)
                if not (compiled and s.part == "rope tables")]
    elif symbol == Symbols.MLP:
        mlp = _mlp_storages(config, d.tokens, config.ffn_hidden_size, d.tp, d.a)
        out += mlp[:2] + mlp[-1:] if compiled else mlp
    elif symbol == Symbols.MOE:
        out += _moe_storages(config, d)
    elif symbol == Symbols.MAMBA and config.gdp_layers:
        out += _gated_delta_product_storages(config, d, compiled)
    elif symbol == Symbols.MAMBA:
        out += _mamba_storages(config, d, compiled)
    else:
        out += _gated_delta_net_storages(config, kernels, d, compiled)
    if config.hidden_dropout > 0:
        out.append(_saved("dropout masks", kernels.dropout_bytes_per_element(d.a) * Tn * h, Tn * h))
    return out


def _check_hybrid(config, kernels: KernelProfile, symbols: str) -> None:
    """What the estimate does not model for hybrid models (`symbols`: their layers): one line each."""
    if recurrent(symbols) and not kernels.triton_scans:
        raise NotModelled("Mamba and Gated DeltaNet layers off the GPU run PyTorch reference scans, which the "
                          "estimate does not model; estimate for CUDA (the default device)")
    if config.fine_grained_activation_offloading:
        raise NotModelled("--fine-grained-activation-offloading with --hybrid-layer-pattern: the estimate does not "
                          "model what the hybrid layers offload; drop one")


def recurrent(symbols: str) -> bool:
    """Whether a hybrid model's layer symbols include a recurrent mixer (Mamba-2 or Gated Delta Product,
    Gated DeltaNet)."""
    return Symbols.MAMBA in symbols or Symbols.GDN in symbols


def _selective(config) -> set:
    return set(config.recompute_modules or []) if config.recompute_granularity == "selective" else set()


def layer_storages(config, kernels: KernelProfile, d: Dims, rope_dim: int, is_moe: bool,
                   input_is_new: bool = True, compiled: bool = False, a2a: int = 1) -> list:
    """The storages one transformer layer keeps (no full recompute). `input_is_new`: nothing
    else (the pipeline schedule) already holds the layer's input. `compiled`: the layer is
    compiled (see the module docstring). `a2a`: the group size over which context parallelism
    exchanges this layer's heads (1: none)."""
    if compiled:  # decomposed norms and dropout, on every device
        kernels = replace(kernels, fused_rms_norm=True, fused_dropout=True)
    selective = _selective(config)
    h, Tn = config.hidden_size, d.norm_tokens
    if "layernorm" in selective:  # the checkpoints keep only each norm's input
        out = [_saved("norms", d.r * Tn * h, Tn * h)] * (int(input_is_new) + 1)
    else:
        out = (norm_storages(config, kernels, "norms", Tn * h, Tn, d.r, input_is_new, "attn_norm")
               + norm_storages(config, kernels, "norms", Tn * h, Tn, d.r, True, "mlp_norm"))
    if config.multi_latent_attention:
        attention = _mla_attention_storages(config, kernels, d, rope_dim, "core_attn" in selective,
                                            "mla_up_proj" in selective)
    else:
        attention = _attention_storages(config, kernels, d, rope_dim, "core_attn" in selective, a2a)
    out += [s for s in attention if not (compiled and s.part == "rope tables")]
    if ("moe" if is_moe else "mlp") in selective:
        out.append(_saved("mlp checkpoint input", d.a * Tn * h, Tn * h))
    elif is_moe:
        out += _moe_storages(config, d)
    else:
        mlp = _mlp_storages(config, d.tokens, config.ffn_hidden_size, d.tp, d.a, savers=("mlp",) * 3)
        out += mlp[:2] + mlp[-1:] if compiled else mlp  # compiled: SwiGLU's act(gate) and up recomputed
    if config.hidden_dropout > 0:
        out.append(_saved("dropout masks", 2 * kernels.dropout_bytes_per_element(d.a) * Tn * h, Tn * h))
    return out


def _offloaded_savers(config, saved: Saved) -> set:
    """The offloaded modules among a storage's savers (none when it is too small to move)."""
    if not config.fine_grained_activation_offloading or saved.numel < config.min_offloaded_tensor_size:
        return set()
    return saved.savers & set(config.offload_modules)


def layer_bytes(config, kernels: KernelProfile, d: Dims, rope_dim: int, is_moe: bool,
                input_is_new: bool = True, compiled: bool = False, a2a: int = 1, symbol: str | None = None) -> tuple:
    """({part: bytes on the device}, bytes copied to the host) of one transformer layer (`symbol`:
    a hybrid model's layer). An offloading module copies a storage to the host; it leaves the
    device only when every module keeping it offloads."""
    parts, host = {}, 0
    storages = (hybrid_layer_storages(config, kernels, d, rope_dim, symbol, input_is_new, compiled, a2a) if symbol else
                layer_storages(config, kernels, d, rope_dim, is_moe, input_is_new, compiled, a2a))
    for saved in storages:
        offloaded = _offloaded_savers(config, saved)
        host += saved.nbytes if offloaded else 0
        if saved.counted and offloaded != saved.savers:
            parts[saved.part] = parts.get(saved.part, 0) + saved.nbytes
    return parts, host


def _keeps_layer_input(config, kernels: KernelProfile, residual_bytes: int) -> bool:
    return (config.recompute_granularity == "full" or "layernorm" in _selective(config)
            or _norm_keeps_input(config, kernels, residual_bytes))


def _layer_input_offloaded(config, numel: int) -> bool:
    """Whether the first layer's input norm offloads the layer input (a storage of `numel`)."""
    return (config.recompute_granularity != "full" and "layernorm" not in _selective(config)
            and bool(_offloaded_savers(config, _saved("", 0, numel, "attn_norm"))))


def rope_dim_for(config, shape: ModelShape) -> int:
    if config.multi_latent_attention:  # rotates its positional channels whatever the type
        percent = config.rotary_percent if config.rope_type == "rope" else 1.0
        return int(config.qk_pos_emb_head_dim * percent)
    if shape.position_embedding_type not in ("rope", "yarn"):
        return 0
    return int(config.kv_channels * shape.rotary_percent)


def chunk_activations(config, kernels: KernelProfile, shape: ModelShape, micro_batch_size: int,
                      layer_numbers: list, pre_process: bool, post_process: bool,
                      compiled: bool = False) -> ChunkActivations:
    """Activation bytes of one micro-batch through one model chunk on one rank; `compiled`: the
    transformer layers are compiled (`teratron train --torch-compile`)."""
    if config.attention_backend in _REFERENCE_BACKENDS:
        raise NotModelled(f"attention_backend={config.attention_backend.name}: the estimate models SDPA "
                         "attention (auto/flash/fused); the reference path keeps s x s scores")
    if config.multi_latent_attention and max(a2a_group_size(config, n) for n in layer_numbers or [1]) > 1:
        raise NotModelled("multi-latent attention with cp_comm_type a2a / a2a+p2p: the estimate does not model "
                          "which of MLA's tensors the head exchange keeps; use p2p or all_gather")
    if config.multi_latent_attention and config.fine_grained_activation_offloading:
        raise NotModelled("fine_grained_activation_offloading with multi_latent_attention: the estimate does not "
                          "model which latents each module offloads; drop one")
    symbols = hybrid_symbols(config)
    if symbols:
        _check_hybrid(config, kernels, symbols)
    d = dims_for(config, shape, micro_batch_size)
    h, Tn, rope = config.hidden_size, d.norm_tokens, rope_dim_for(config, shape)
    moe_layers = {i + 1 for i in moe_layer_indices(config)} if config.num_moe_experts else set()
    result = ChunkActivations()
    hidden = d.r * Tn * h  # one [Tn, h] tensor of the residual stream
    if pre_process:
        # int64 token (and position) ids; under TP also the bool mask of ids outside the shard.
        ids = 2 if shape.position_embedding_type == "learned_absolute" else 1
        result.extra["embedding"] = 8 * d.tokens * ids + (d.tokens if d.tp > 1 else 0)
        if config.hidden_dropout > 0:
            result.extra["embedding"] += kernels.dropout_bytes_per_element(d.a) * Tn * h
        elif d.sp and d.tp > 1 and (compiled or _keeps_layer_input(config, kernels, d.r)):
            # The first layer's input is a view of the whole embedding output before the
            # sequence scatter; keeping it keeps all s tokens (on the host when offloaded).
            whole = d.r * (d.tokens - Tn) * h
            if layer_numbers and _layer_input_offloaded(config, d.tokens * h):
                result.host += whole
            else:
                result.extra["embedding"] += whole
    else:
        result.extra["stage input"] = hidden
    if not post_process and not config.deallocate_pipeline_outputs:
        result.extra["stage output"] = hidden

    layers, host = [], []
    for i, n in enumerate(layer_numbers):
        parts, offloaded = layer_bytes(config, kernels, d, rope, n in moe_layers,
                                       input_is_new=pre_process or i > 0, compiled=compiled,
                                       a2a=a2a_group_size(config, n), symbol=symbols[n - 1] if symbols else None)
        layers.append(parts)
        host.append(offloaded)
    if layers or (post_process and config.mtp_num_layers):
        result.backward_transient = BACKWARD_GRADIENT_FACTOR * _largest_tensor(config, d, bool(moe_layers), symbols)
    if config.recompute_granularity == "full":
        layers = _full_recompute(config, result, layers, hidden, pre_process, rope, d)
        host = host[len(host) - (len(layers) - 1):]  # recomputed layers offload nothing
    if rope and layers and config.recompute_granularity != "full" and (compiled or "mla_up_proj" in _selective(config)):
        result.extra["rope angles"] = 4 * d.tokens * rope  # fp32 [s, b, 1, rot], one tensor for all layers
    result.layers = layers
    if any(host):
        # A layer holds its offloaded storages until its forward ends; in backward a layer's
        # reloaded storages and the prefetched previous layer's are on the device.
        result.host += sum(host)
        result.forward_transient = max(host)
        result.backward_transient += 2 * max(host)
    if layer_numbers and config.context_parallel_size > 1:
        forward, backward = zip(*(context_parallel_transients(config, d, n, symbols[n - 1] if symbols else None)
                                  for n in layer_numbers))
        result.forward_transient = max(result.forward_transient, max(forward))
        result.backward_transient += max(backward)
        depths = range(config.num_layers + 1, config.num_layers + (config.mtp_num_layers or 0) + 1)
        mtp_layers = [n for depth in depths for n in mtp_depth_layers(config, depth)] if post_process else []
        orders = _context_parallel_orders(config, d, layer_numbers + mtp_layers, symbols)
        if orders:
            result.extra["context-parallel order"] = orders

    if post_process:
        vocab = shape.padded_vocab_size // d.tp
        result.extra["output"] = norm_bytes(config, kernels, Tn * h, Tn, d.r, True) + _output_bytes(config, d, vocab)
        if config.cross_entropy_loss_fusion:
            chunk = min(default_chunk_size(vocab), d.tokens)
            forward, result.loss_backward_transient = fused_loss_transients(
                d.a, d.tokens, h, vocab, chunk, kernels.compiled_loss)
        else:
            forward, backward = _cross_entropy_working(d.a, kernels.compiled_loss, d.tokens, vocab)
            result.backward_transient = max(result.backward_transient, backward)
        result.forward_transient = max(result.forward_transient, forward)
        if config.mtp_num_layers:
            result.layers += _mtp_depths(config, kernels, d, rope, moe_layers, vocab, compiled, result)
            result.extra["mtp loss"] = 4  # the fp32 scalar joined to the LM loss's backward
    return result


def a2a_group_size(config, layer_number: int) -> int:
    """The ranks over which context parallelism exchanges layer `layer_number`'s heads (1: none)."""
    if config.context_parallel_size == 1:
        return 1
    comm_type = layer_cp_comm_type(config.cp_comm_type, layer_number)
    if comm_type == "a2a":
        return config.context_parallel_size
    return config.hierarchical_context_parallel_sizes[0] if comm_type == "a2a+p2p" else 1


def _context_parallel_orders(config, d: Dims, layer_numbers: list, symbols: str) -> int:
    """Bytes of the int64 token orders (and their inverses) that the chunk's head exchanges keep:
    one pair per exchange group size, shared by every layer (a2a attention, recurrent mixers)."""
    if config.recompute_granularity == "full":
        return 0
    sizes = {config.context_parallel_size for n in layer_numbers if symbols and recurrent(symbols[n - 1])}
    if "core_attn" not in _selective(config):
        sizes |= {a2a_group_size(config, n) for n in layer_numbers
                  if not symbols or symbols[n - 1] == Symbols.ATTENTION}
    return sum(2 * 8 * size * d.s for size in sizes - {1})


def context_parallel_transients(config, d: Dims, layer_number: int, symbol: str | None = None) -> tuple:
    """(forward, backward) bytes layer `layer_number`'s exchange (`symbol`: a hybrid model's layer)
    holds beyond what it keeps. A recurrent mixer's: its inputs sent and received, each way (the
    larger of its two exchanges). Attention's, with KV this rank's keys and values (a bytes), KV32
    their fp32 gradients, O32 the fp32 output, L the log-sum-exp and Q32 the fp32 query gradient:
      p2p         forward 2 KV (in hand, arriving) + 2 (O32 + L) (merged, one block's);
                  backward 2 KV + 3 KV32 (this step's, in flight, arriving) + Q32 + one block's
                  q, k, v gradients
      all_gather  forward cp KV + 2 (O32 + L); backward cp KV + (cp + 1) KV32 + Q32 + a block's
      a2a         q, k, v sent and received: 2 x their bytes, each way
      a2a+p2p     the larger of its a2a's and its ring's (over the group's tokens, its heads: the
                  same bytes as p2p)"""
    if symbol in (Symbols.MLP, Symbols.MOE):
        return 0, 0
    if symbol in (Symbols.MAMBA, Symbols.GDN):
        exchanged = 2 * d.a * d.tokens * config.context_parallel_size * _mixer_share(config, d, symbol)[4]
        return exchanged, exchanged
    comm_type = layer_cp_comm_type(config.cp_comm_type, layer_number)
    cp, T, a = config.context_parallel_size, d.tokens, d.a
    heads, groups = config.num_attention_heads // d.tp, config.num_query_groups // d.tp
    hq = hv = config.kv_channels
    if config.multi_latent_attention:
        hq, hv, groups = config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim, heads
    kv = T * groups * (hq + hv)
    out32, lse, q32 = 4 * T * heads * hv, 4 * T * heads, 4 * T * heads * hq
    block_grads = a * (T * heads * hq + kv)
    ring = (2 * a * kv + 2 * (out32 + lse), 2 * a * kv + 3 * 4 * kv + q32 + block_grads)
    if comm_type == "p2p":
        return ring
    if comm_type == "all_gather":
        return cp * a * kv + 2 * (out32 + lse), cp * a * kv + (cp + 1) * 4 * kv + q32 + block_grads
    size = a2a_group_size(config, layer_number)
    kv_heads = groups if groups % size == 0 else heads
    exchanged = 2 * a * T * (heads * hq + kv_heads * (hq + hv))
    if comm_type == "a2a":
        return exchanged, exchanged
    return max(exchanged, ring[0]), max(exchanged, ring[1])
def _output_bytes(config, d: Dims, vocab: int) -> int:
    """The output layer's input and, unfused, the logits and per token the max, log-sum-exp
    (fp32), target (int64) and mask; fused, the int64 targets only."""
    kept = d.a * d.tokens * config.hidden_size
    if config.cross_entropy_loss_fusion:
        return kept + 8 * d.tokens
    return kept + d.a * d.tokens * vocab + 17 * d.tokens


def _mtp_depths(config, kernels, d: Dims, rope: int, moe_layers: set, vocab: int, compiled: bool,
                result: ChunkActivations) -> list:
    """{part: bytes} of each multi-token-prediction depth (see the module docstring); adds a
    recomputed depth's storages to the backward transient under full recompute."""
    h, T, Tn = config.hidden_size, d.tokens, d.norm_tokens
    ids = 8 * T + (T if d.tp > 1 else 0)  # the shifted ids the lookup keeps (and its TP mask)
    dropout = kernels.dropout_bytes_per_element(d.a) * Tn * h if config.hidden_dropout > 0 else 0
    # Under SP the embeddings are a view of the whole lookup output before the scatter (unless
    # dropout copied them): what keeps them (the checkpoint, or an enorm keeping its input) keeps it.
    whole = d.sp and d.tp > 1 and not dropout
    layer_kernels = replace(kernels, fused_rms_norm=True) if compiled else kernels
    symbols = hybrid_symbols(config)
    depths = []
    for number in range(config.num_layers + 1, config.num_layers + config.mtp_num_layers + 1):
        # The loss: the shifted fp32 mask of the masked sum, and the clamped token count.
        kept = {"mtp ids and mask": ids + 4 * T + 4, "mtp output": _output_bytes(config, d, vocab)}
        if config.recompute_granularity == "full":
            # The checkpoint keeps the embeddings and h_{k-1} (under SP the output layer keeps
            # only its gathered copy).
            kept["mtp checkpoint input"] = (d.r * (T if whole else Tn) * h + dropout
                                            + (d.a * Tn * h if d.sp and d.tp > 1 else 0))
        else:
            norms = (norm_storages(config, kernels, "n", Tn * h, Tn, d.r, True)
                     + norm_storages(config, kernels, "n", Tn * h, Tn, d.a, d.sp and d.tp > 1))
            whole_kept = whole and _norm_keeps_input(config, kernels, d.r)
            kept["mtp norms"] = sum(x.nbytes for x in norms if x.counted) + dropout + (
                d.r * (T - Tn) * h if whole_kept else 0)
            kept["mtp eh_proj input"] = d.a * (T if d.sp else Tn) * 2 * h
            offloaded = 0
            for n in mtp_depth_layers(config, number):
                symbol = symbols[n - 1] if symbols else None
                # --torch-compile compiles TransformerLayers and the decoder's layers: not a depth's Mamba layers
                layer, layer_offloaded = layer_bytes(config, kernels, d, rope, n in moe_layers, symbol=symbol,
                                                     compiled=compiled and symbol != Symbols.MAMBA,
                                                     a2a=a2a_group_size(config, n))
                offloaded += layer_offloaded
                for part, nbytes in layer.items():
                    kept[part] = kept.get(part, 0) + nbytes
            result.host += offloaded
            result.forward_transient = max(result.forward_transient, offloaded)
            if d.sp and d.tp > 1 and ("layernorm" in _selective(config)
                                      or _norm_keeps_input(config, layer_kernels, d.a)):
                kept["mtp eh_proj input"] += d.a * (T - Tn) * h  # the layer's input: a view of eh_proj's output
            kept["mtp norms"] += norm_bytes(config, kernels, Tn * h, Tn, d.r, True)  # the final norm
        depths.append(kept)
    return depths


def _cross_entropy_working(a: int, compiled: bool, tokens: int, vocab: int) -> tuple:
    """(forward, backward) bytes vocab_parallel_cross_entropy allocates beyond the logits it keeps,
    for [tokens, vocab] logits of `a` bytes. Compiled (CUDA): each pass is one kernel, so only the
    logits' gradient. Eager: forward's peak is the shifted logits, their exponentials and the
    masked exponentials (fp32) and the [vocab] real-column mask; backward's the shifted logits, the
    softmax, the target mask (bool), the gradient, its product with the upstream gradient and that
    cast to `a` bytes, and the [vocab] column ids (int64) and mask."""
    logits = tokens * vocab
    if compiled:
        return 0, a * logits
    return 12 * logits + vocab, (17 + (a if a != 4 else 0)) * logits + 9 * vocab


def fused_loss_transients(a: int, tokens: int, hidden: int, vocab: int, chunk: int, compiled: bool = False) -> tuple:
    """(forward, backward) bytes the fused output layer + cross entropy
    (tensor_parallel.fused_cross_entropy) allocates on top of what it keeps, for `tokens` tokens
    in chunks of `chunk` over `vocab` columns with `a`-byte weights (per-token vectors left out);
    `compiled`: the cross entropy's passes are compiled kernels (CUDA).

    Forward, one chunk at a time: its logits [chunk, vocab] and the loss's working set. Backward:
    d(hidden) [T, h] and the fp32 weight-gradient accumulator [vocab, h], and per chunk the
    recomputed logits with the loss's forward working set, then its backward; the previous
    chunk's logits (through its loss's graph) and logit gradient are still referenced until the
    loop rebinds them. With 16-bit weights each chunk's [vocab, h] weight-gradient product is
    added to the accumulator, and the final cast back (this loss's parameter gradient) is as big."""
    elements = chunk * vocab
    loss_forward, loss_backward = _cross_entropy_working(a, compiled, chunk, vocab)
    held = a * elements if tokens > chunk else 0  # one of the previous chunk's [chunk, vocab] tensors
    product = a * vocab * hidden if a != 4 else 0
    chunk_peak = max(a * elements + loss_forward + 2 * held,   # the loss's forward
                     a * elements + loss_backward + held,      # the loss's backward
                     2 * a * elements + product)               # logits, their gradient, the product
    return a * elements + loss_forward, a * tokens * hidden + 4 * vocab * hidden + chunk_peak


def _largest_tensor(config, d: Dims, has_moe: bool, symbols: str = "") -> int:
    """Bytes of the biggest activation of a layer: the fc1 output, the QKV output, [T, h] or a
    recurrent mixer's in_proj output."""
    gate = 2 if config.gated_linear_unit else 1
    hn = config.kv_channels
    sizes = [d.tokens * config.hidden_size,
             d.tokens * (config.num_attention_heads + 2 * config.num_query_groups) * hn // d.tp,
             d.tokens * gate * config.ffn_hidden_size // d.tp]
    if config.multi_latent_attention:  # the kv up projection's output, q or k
        sizes[1] = d.tokens * config.num_attention_heads // d.tp * max(
            config.qk_head_dim + config.v_head_dim, config.qk_head_dim + config.qk_pos_emb_head_dim)
    if Symbols.MAMBA in symbols:
        heads, bc = mamba_num_heads(config), config.mamba_num_groups * config.mamba_state_dim
        d_inner = heads * config.mamba_head_dim  # Gated Delta Product: [z V_m K_m Q b_m a], else [z x B C dt]
        width = ((config.gdp_num_householder + 1) * (d_inner + bc + heads) if config.gdp_layers
                 else 2 * d_inner + 2 * bc + heads)
        sizes.append(d.tokens * width // d.tp)
    if Symbols.GDN in symbols:
        v_heads = config.linear_num_value_heads
        sizes.append(d.tokens * 2 * (config.linear_num_key_heads * config.linear_key_head_dim
                                     + v_heads * config.linear_value_head_dim + v_heads) // d.tp)
    if has_moe:
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
