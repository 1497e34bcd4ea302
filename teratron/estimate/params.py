"""Parameter counts per rank, by part, for one model chunk (a pipeline stage or virtual stage).

The counts follow the layers teratron builds (Megatron's local spec): fused QKV
[(q + 2 kv) / tp, h], linear_proj [h, q / tp] (multi-latent attention: `mla_params`),
linear_fc1 [ffn * (2 if gated) / tp, h], linear_fc2 [h, ffn / tp], norms of h (+ h bias for
LayerNorm), the vocab-parallel word embedding [V / tp, h], a replicated learned position table,
and under MoE a replicated router [E, h], E / ep local experts sharded over expert-TP and an
optional TP-sharded shared expert. The multi-token-prediction depths sit with the loss: each
holds three norms, eh_proj [h / tp, 2h] and a layer like the last decoder layer, and their stage
a copy of the word embedding (which a tied output layer then uses). A hybrid model's layers
(--hybrid-layer-pattern) are each one norm and one half of a GPT layer (`*` attention, `-` MLP,
`E` MoE) or a recurrent mixer (`mamba_params`, `gated_delta_product_params` with gdp_layers,
`gated_delta_net_params`); its MTP depths hold the layers after '/'. Tests compare them with the
numel of real models.
"""

from dataclasses import dataclass, field

from teratron.models.hybrid import Symbols, mtp_depth_layer_numbers, parse_hybrid_pattern
from teratron.ssm.mamba_mixer import D_CONV, mamba_num_heads
from teratron.transformer.moe.moe_logging import moe_layer_indices


@dataclass(frozen=True)
class ModelShape:
    """What the parameter and activation counts need beyond the TransformerConfig."""

    padded_vocab_size: int
    seq_length: int
    max_position_embeddings: int
    position_embedding_type: str = "rope"
    share_embeddings_and_output_weights: bool = False
    rotary_percent: float = 1.0

    @classmethod
    def of(cls, model, seq_length: int) -> "ModelShape":
        """The shape of a GPTModelConfig trained on sequences of `seq_length`."""
        return cls(padded_vocab_size=model.padded_vocab_size, seq_length=seq_length,
                   max_position_embeddings=model.max_position_embeddings,
                   position_embedding_type=model.position_embedding_type,
                   share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
                   rotary_percent=model.rotary_percent)


@dataclass
class ChunkParams:
    """Elements per part on one rank of one model chunk; `expert` parts are expert-parallel."""

    dense: dict = field(default_factory=dict)   # part -> elements, reduced over data parallel
    expert: dict = field(default_factory=dict)  # part -> elements, reduced over expert-data parallel
    largest: int = 0                            # elements of the biggest single parameter

    def add(self, part: str, elements: int, is_expert: bool = False) -> None:
        if elements:
            target = self.expert if is_expert else self.dense
            target[part] = target.get(part, 0) + elements
            self.largest = max(self.largest, elements)

    @property
    def total(self) -> int:
        return sum(self.dense.values()) + sum(self.expert.values())


def _norm(config, width: int) -> int:
    return width * (2 if config.normalization == "LayerNorm" else 1)


def _mlp(config, ffn: int, tp: int) -> list:
    """[(elements, ...)] of one MLP's weights and biases: fc1, fc2 (and their biases)."""
    fc1 = ffn * (2 if config.gated_linear_unit else 1)
    weights = [fc1 // tp * config.hidden_size, config.hidden_size * (ffn // tp)]
    if config.add_bias_linear:
        weights += [fc1 // tp, config.hidden_size]
    return weights


def attention_params(config) -> list:
    if config.multi_latent_attention:
        return mla_params(config)
    tp, h, hn = config.tensor_model_parallel_size, config.hidden_size, config.kv_channels
    q, kv = config.num_attention_heads * hn, config.num_query_groups * hn
    qkv = q * (2 if config.attention_output_gate else 1) + 2 * kv  # the gates are projected with q
    sizes = [qkv // tp * h, h * (q // tp)]
    if config.add_bias_linear or config.add_qkv_bias:
        sizes.append(qkv // tp)
    if config.add_bias_linear:
        sizes.append(h)
    if config.qk_layernorm:
        sizes += [_norm(config, hn), _norm(config, hn)]
    return sizes


def mla_params(config) -> list:
    """Multi-latent attention: the down projections [d_q, h] and [d_c + d_r, h] and the latent
    norms whole on every rank; the up projections (or linear_q_proj) and linear_proj split over TP."""
    tp, h, heads = config.tensor_model_parallel_size, config.hidden_size, config.num_attention_heads
    dn, dr, dv, dc = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim, config.kv_lora_rank
    if config.q_lora_rank is None:
        sizes = [heads * (dn + dr) // tp * h]
    else:
        sizes = [config.q_lora_rank * h, heads * (dn + dr) // tp * config.q_lora_rank]
    sizes += [(dc + dr) * h, heads * (dn + dv) // tp * dc, h * (heads * dv // tp)]
    if config.add_bias_linear:
        sizes.append(h)
    if config.qk_layernorm:
        sizes += [_norm(config, dc)] + ([_norm(config, config.q_lora_rank)] if config.q_lora_rank else [])
    return sizes


def moe_params(config) -> tuple:
    """(router and shared expert sizes, local expert sizes) of one MoE layer."""
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size
    local = config.num_moe_experts // ep
    ffn, h = config.moe_ffn_hidden_size, config.hidden_size
    if config.moe_grouped_gemm:
        # GroupedMLP stacks the local experts: one weight1, one weight2 (biases unsharded).
        fc1 = ffn * (2 if config.gated_linear_unit else 1)
        experts = [local * h * (fc1 // etp), local * (ffn // etp) * h]
        if config.add_bias_linear:
            experts += [local * fc1, local * h]
    else:
        experts = _mlp(config, ffn, etp) * local
    dense = [config.num_moe_experts * h] + ([config.num_moe_experts] if config.add_bias_linear else [])
    if config.moe_shared_expert_intermediate_size is not None:
        dense += _mlp(config, config.moe_shared_expert_intermediate_size, config.tensor_model_parallel_size)
        dense += [h] if config.moe_shared_expert_gate else []
    return dense, experts


def mamba_params(config) -> list:
    """A Mamba mixer on one rank: in_proj [z, x, B, C, dt] / tp by h, the depthwise convolution over
    [x, B, C] / tp (weight and bias), dt_bias, A_log and D per head, the gated norm's weight
    [d_inner / tp] and out_proj [h, d_inner / tp]; no projection biases."""
    tp, h = config.tensor_model_parallel_size, config.hidden_size
    heads, bc = mamba_num_heads(config), config.mamba_num_groups * config.mamba_state_dim
    d_inner = heads * config.mamba_head_dim
    conv = (d_inner + 2 * bc) // tp
    return [(2 * d_inner + 2 * bc + heads) // tp * h, conv * D_CONV, conv, *3 * [heads // tp], d_inner // tp,
            h * (d_inner // tp)]


def gated_delta_product_params(config) -> list:
    """A Gated Delta Product mixer (an 'M' layer with gdp_layers; M = gdp_num_householder) on one rank:
    in_proj [z, V_m, K_m, Q, b_m, a] / tp by h, the convolution over [V_m, K_m, Q] / tp (no bias),
    dt_bias and A_log per head, the gated norm's weight [d_inner / tp] and out_proj [h, d_inner / tp]; no D,
    no projection biases."""
    tp, h, m = config.tensor_model_parallel_size, config.hidden_size, config.gdp_num_householder
    heads, gn = mamba_num_heads(config), config.mamba_num_groups * config.mamba_state_dim
    d_inner = heads * config.mamba_head_dim
    return [(m + 1) * (d_inner + gn + heads) // tp * h, (m * d_inner + (m + 1) * gn) // tp * D_CONV,
            *2 * [heads // tp], d_inner // tp, h * (d_inner // tp)]


def recurrent_mixer_params(config, symbol: str) -> tuple:
    """(report part, sizes) of a hybrid layer's recurrent mixer: 'M' Mamba-2's (Gated Delta Product's with
    gdp_layers), 'G' Gated DeltaNet's."""
    if symbol == Symbols.GDN:
        return "gated deltanet", gated_delta_net_params(config)
    if config.gdp_layers:
        return "gated delta product", gated_delta_product_params(config)
    return "mamba", mamba_params(config)


def gated_delta_net_params(config) -> list:
    """A Gated DeltaNet on one rank: in_proj [q, k, v, z, b, a] / tp by h, the convolution over
    [q, k, v] / tp (no bias), dt_bias and A_log per value head, out_norm over a value head (whole on
    every rank) and out_proj [h, v / tp]; no projection biases."""
    tp, h = config.tensor_model_parallel_size, config.hidden_size
    qk = config.linear_num_key_heads * config.linear_key_head_dim
    v, v_heads = config.linear_num_value_heads * config.linear_value_head_dim, config.linear_num_value_heads
    return [(2 * qk + 2 * v + 2 * v_heads) // tp * h, (2 * qk + v) // tp * config.linear_conv_kernel_dim,
            v_heads // tp, v_heads // tp, _norm(config, config.linear_value_head_dim), h * (v // tp)]


def hybrid_symbols(config) -> str:
    """A hybrid model's layer symbols, decoder layers then each MTP depth's (layer n is symbol
    n - 1), or '' for a GPT model."""
    if config.hybrid_layer_pattern is None:
        return ""
    pattern = parse_hybrid_pattern(config.hybrid_layer_pattern)
    return pattern.layers + pattern.mtp_layers * pattern.mtp_depths


def mtp_depth_layers(config, depth_number: int) -> list:
    """The layer numbers (as `hybrid_symbols` counts them) of MTP depth `depth_number` (the model's
    num_layers + 1, + 2, ...): one number, a GPT depth's layer like the last decoder layer, or a
    hybrid depth's layers."""
    if config.hybrid_layer_pattern is None:
        return [depth_number]
    per_depth = len(parse_hybrid_pattern(config.hybrid_layer_pattern).mtp_layers)
    return list(mtp_depth_layer_numbers(config.num_layers, per_depth, depth_number - config.num_layers))


def chunk_params(config, shape: ModelShape, layer_numbers: list, pre_process: bool,
                 post_process: bool) -> ChunkParams:
    """Parameters on one rank of the chunk holding global layers `layer_numbers` (1-based; the
    multi-token-prediction layers come with post_process)."""
    tp, h = config.tensor_model_parallel_size, config.hidden_size
    params = ChunkParams()
    mtp = post_process and bool(config.mtp_num_layers)
    if pre_process or mtp:
        params.add("embedding", shape.padded_vocab_size // tp * h)
    if pre_process and shape.position_embedding_type == "learned_absolute":
        params.add("embedding", shape.max_position_embeddings * h)
    moe_layers = {i + 1 for i in moe_layer_indices(config)} if config.num_moe_experts else set()
    symbols = hybrid_symbols(config)
    for number in layer_numbers:
        _add_layer(params, config, number in moe_layers, symbols[number - 1] if symbols else None)
    if mtp:
        for number in range(config.num_layers + 1, config.num_layers + config.mtp_num_layers + 1):
            params.add("mtp", 3 * _norm(config, h))  # enorm, hnorm, final norm
            params.add("mtp", h // tp * 2 * h)  # eh_proj
            for layer in mtp_depth_layers(config, number):
                _add_layer(params, config, layer in moe_layers, symbols[layer - 1] if symbols else None)
    if post_process:
        params.add("norms", _norm(config, h))
        if not ((pre_process or mtp) and shape.share_embeddings_and_output_weights):
            params.add("output layer", shape.padded_vocab_size // tp * h)
    return params


def _add_layer(params: ChunkParams, config, is_moe: bool, symbol: str | None = None) -> None:
    """A GPT layer (symbol None), or a hybrid layer: one norm and the part `symbol` names."""
    params.add("norms", (1 if symbol else 2) * _norm(config, config.hidden_size))
    if symbol in (None, Symbols.ATTENTION, Symbols.MLA):  # attention_params: MLA's with multi_latent_attention
        for size in attention_params(config):
            params.add("attention", size)
    if symbol in (Symbols.MAMBA, Symbols.GDN):
        name, sizes = recurrent_mixer_params(config, symbol)
        for size in sizes:
            params.add(name, size)
    if symbol in (Symbols.ATTENTION, Symbols.MLA, Symbols.MAMBA, Symbols.GDN):
        return
    if is_moe:
        dense, experts = moe_params(config)
        for size in dense:
            params.add("moe router+shared", size)
        for size in experts:
            params.add("moe experts", size, is_expert=True)
    else:
        for size in _mlp(config, config.ffn_hidden_size, config.tensor_model_parallel_size):
            params.add("mlp", size)
