"""TransformerConfig and MLATransformerConfig: the shape and behaviour of a transformer stack.

Field names, meanings and defaults follow Megatron Core's `core.transformer.transformer_config`
(the API reference in seeds/003). Fields the reference lists with a default of None but that
Megatron resolves to a value (activation_func -> F.gelu, attention_backend -> AttnBackend.auto,
recompute_modules -> ["core_attn"], init methods, ffn_hidden_size, ...) are resolved in
`__post_init__`, so a built config always holds the effective values.

transformer_impl: 'local' and 'transformer_engine' are both accepted and both mean teratron's own
layers (teratron has no Transformer Engine dependency); the default keeps Megatron's spelling.

Features teratron does not have yet are listed in `UNSUPPORTED` (one line per field); a value
other than the field's default raises NotImplementedError naming the field.
"""

import warnings
from dataclasses import dataclass
from typing import Callable, List, Literal, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from teratron.model_parallel_config import ModelParallelConfig, check_unsupported
from teratron.fp8.recipe import check_fp8_config
from teratron.pipeline_parallel.layout import validate_pipeline_config
from teratron.transformer.cuda_graphs import check_cuda_graph_config
from teratron.transformer.enums import AttnBackend
from teratron.utils import init_method_normal, scaled_init_method_normal

# YaRN of plain attention (position_embedding_type 'yarn') and the defaults that mean "no YaRN".
YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")

# field -> the feature it needs. Non-default values raise NotImplementedError.
UNSUPPORTED = {
    "moe_latent_size": "latent MoE projections",
    "activation_func_fp8_input_store": "FP8 activation storage",
    "disable_bf16_reduced_precision_matmul": "the bf16 reduced-precision matmul switch",
    "masked_softmax_fusion": "fused masked softmax",
    "persist_layer_norm": "persistent fused LayerNorm",
    "memory_efficient_layer_norm": "Apex memory-efficient LayerNorm",
    "use_fused_weighted_squared_relu": "fused weighted squared ReLU",
    "fused_single_qkv_rope": "fused QKV RoPE",
    "distribute_saved_activations": "distributing recomputed activations over TP",
    "fp8_param": "FP8 parameters (FP8 weights with higher-precision master copies)",
    "fp8_quantizer_factory": "custom FP8 quantizers (fp8_recipe='custom')",
    "fp8_dot_product_attention": "FP8 attention (FP8 covers the linear layers only)",
    "fp8_multi_head_attention": "FP8 attention (FP8 covers the linear layers only)",
    "use_kitchen": "the kitchen quantization extension",
    "use_kitchen_attention": "the kitchen quantization extension",
    "kitchen_attention_backend": "the kitchen quantization extension",
    "fp4": "FP4 training",
    "fp4_recipe": "FP4 training",
    "fp4_param": "FP4 training",
    "fp4_quantizer_factory": "FP4 training",
    "moe_enable_deepep": "the flex token dispatcher (DeepEP/HybridEP)",
    "moe_flex_dispatcher_backend": "the flex token dispatcher (DeepEP/HybridEP)",
    "moe_deepep_num_sms": "the flex token dispatcher (DeepEP/HybridEP)",
    "moe_hybridep_num_sms": "the flex token dispatcher (DeepEP/HybridEP)",
    "moe_permute_fusion": "fused MoE permutation",
    "moe_router_fusion": "fused MoE routing",
    "clone_scatter_output_in_embedding": "not cloning the SP-scattered embedding output",
    "disable_parameter_transpose_cache": "Transformer Engine's parameter transpose cache",
    "flash_decode": "the flash-decoding inference kernel",
    "use_te_activation_func": "Transformer Engine activation functions",
    "inference_rng_tracker": "the inference engine",
    "inference_sampling_seed": "the inference engine",
    "symmetric_ar_type": "symmetric-memory all-reduce",
    "use_inference_optimized_layers": "the inference engine",
    "mlp_chunks_for_prefill": "the inference engine",
    "mrope_section": "multimodal RoPE",
    "use_mamba_mem_eff_path": "hybrid (Mamba) models",
    "heterogeneous_block_specs": "heterogeneous layers (nemotron-nas)",
    "hetereogenous_dist_checkpoint": "heterogeneous layers (nemotron-nas)",
    "quant_recipe": "per-module quantization recipes",
}
# Values other than the default that are supported for fields of the table above.
ALSO_SUPPORTED = {"distribute_saved_activations": (False,)}

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "gdn_norm_out",
                     "gdp_in_proj", "gdp_qkv")
SUPPORTED_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "mla_up_proj")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none")
# Fields teratron adds to Megatron's TransformerConfig (each documented where it is declared).
# The yarn_* fields are Megatron's too: config attributes its argument parser sets, not declared.
TERATRON_EXTRA_FIELDS = ("moe_router_quantile_balancing_ema", "fine_grained_activation_offloading",
                         "offload_modules", "min_offloaded_tensor_size", "hybrid_layer_pattern",
                         "freeze_base_model_for_mtp", "moe_shared_expert_gate",  # Megatron's, newer than the reference
                         "attention_output_gate", "gdp_layers",
                         "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",  # so are these
                         "linear_num_key_heads", "linear_num_value_heads", "gdp_num_householder",
                         *YARN_FIELDS)


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Configuration of a transformer stack; also carries every ModelParallelConfig field."""

    ####################
    # model architecture
    ####################
    num_layers: int = 0
    """Number of transformer layers in the block (required)."""

    mtp_num_layers: Optional[int] = None
    """Number of multi-token-prediction layers (depths), on the last pipeline stage; None: no MTP."""

    mtp_loss_scaling_factor: Optional[float] = None
    """Weight of the multi-token-prediction loss (the mean over depths); None means Megatron's 0.1."""

    freeze_base_model_for_mtp: bool = False
    """Train only the MTP layers: every other parameter is frozen and the main model runs without
    autograd (Megatron's MTP-only training, --freeze-base-model-for-mtp)."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on the first pipeline stage; None splits evenly."""

    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last pipeline stage; None splits evenly."""

    pipeline_model_parallel_layout: Optional[Union[str, list, object]] = None
    """Explicit placement of embedding/decoder/loss layers per (virtual) stage, e.g. 'Et|tt|tL'."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting the stack over stages."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the loss as one layer when splitting the stack over stages."""

    hidden_size: int = 0
    """Hidden size h (required)."""

    num_attention_heads: int = 0
    """Number of attention heads (required)."""

    attention_backend: Optional[Union[AttnBackend, str]] = None
    """Core-attention kernel (AttnBackend or its name); None means AttnBackend.auto."""

    softmax_scale: Optional[float] = None
    """Scale of QK^T before softmax; None means 1/sqrt(kv_channels)."""

    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    """Softmax of attention: 'vanilla'; 'off-by-one' adds a zero logit to every softmax's
    denominator; 'learnable' a learned logit per head (`softmax_offset`, an attention sink)."""

    num_query_groups: Optional[int] = None
    """Key/value head groups (GQA); None means num_attention_heads (plain multi-head)."""

    ffn_hidden_size: Optional[int] = None
    """MLP hidden size; None means 4 * hidden_size."""

    kv_channels: Optional[int] = None
    """Per-head dimension; None means hidden_size // num_attention_heads."""

    hidden_dropout: float = 0.1
    """Dropout on the outputs of attention and MLP before the residual add."""

    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""

    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32."""

    apply_residual_connection_post_layernorm: bool = False
    """Take the residual after the norm (original BERT ordering)."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm."""

    layernorm_zero_centered_gamma: bool = False
    """Store norm weights as (gamma - 1), so they start and decay towards zero."""

    add_bias_linear: bool = True
    """Bias in every linear layer (QKV, attention output, both MLP layers)."""

    add_qkv_bias: bool = False
    """Bias in the QKV projection only."""

    gated_linear_unit: bool = False
    """Gated first MLP layer: act(x W_gate) * (x W_up); with F.silu this is SwiGLU."""

    activation_func: Optional[Callable] = None
    """MLP non-linearity; None means F.gelu."""

    activation_func_fp8_input_store: bool = False
    """Store the activation input in FP8 for backward."""

    glu_linear_offset: float = 0.0
    """Offset in the GLU: act(x[0]) * (x[1] + offset)."""

    activation_func_clamp_value: Optional[float] = None
    """Gated MLPs: clamp the gate half of fc1's output to at most this and the linear half to
    [-this, this] before act(gate) * (linear + glu_linear_offset) (gpt-oss's clamped SwiGLU)."""

    num_moe_experts: Optional[int] = None
    """Number of MoE experts; when set the MLP becomes an MoE layer."""

    rotary_interleaved: bool = False
    """RoPE rotates (even, odd) pairs (RoFormer) instead of the two halves (Llama)."""

    # YaRN of plain attention (GPTModel's position_embedding_type 'yarn'; Megatron sets these as
    # config attributes from --rotary-scaling-factor, --mscale, ... ; MLA has its own fields).
    yarn_rotary_scaling_factor: float = 1.0
    """YaRN's context-extension factor s."""

    yarn_original_max_position_embeddings: int = 4096
    """Context length of the original model."""

    yarn_beta_fast: float = 32.0
    """RoPE pairs turning more than this often over the original length keep their frequency."""

    yarn_beta_slow: float = 1.0
    """Pairs turning less than this often are interpolated (frequency / s)."""

    yarn_mscale: float = 1.0
    """YaRN mscale: the rotated channels are scaled by mscale(s, mscale) / mscale(s, mscale_all_dim)."""

    yarn_mscale_all_dim: float = 0.0
    """YaRN mscale_all_dim (see yarn_mscale)."""

    yarn_correction_range_round_to_int: bool = True
    """Round the bounds of the interpolation ramp out to whole pairs (gpt-oss does not)."""

    window_size: Optional[Tuple[int, int]] = None
    """Sliding-window attention (left, right): query i sees keys i - left .. i + right (-1: no
    bound on that side); causal attention also hides every key after i."""

    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    """Which layers keep full attention when window_size is set: N makes every N-th layer full
    ((N-1) windowed, then one full); a list gives one entry per layer, 1 = windowed, 0 = full."""

    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm'."""

    qk_layernorm: bool = False
    """Normalise queries and keys per head (with `normalization`)."""

    attention_output_gate: bool = False
    """Gated attention (Qwen3-Next): linear_qkv also projects a gate per query head, and each head's
    output is multiplied by sigmoid(gate) before linear_proj."""

    qk_clip: bool = False
    """QK-clip (MuonClip): after each optimizer step, scale the query and key weights of every head
    whose largest attention logit exceeded qk_clip_threshold (teratron.optimizer.qk_clip); logs
    the max logit too."""

    qk_clip_alpha: float = 0.5
    """The query's share of the clip, in (0, 1): queries scale by eta ** alpha, keys by
    eta ** (1 - alpha), eta = min(threshold / max_attention_logit, 1)."""

    qk_clip_threshold: float = 100
    """The largest attention logit QK-clip lets a head keep."""

    log_max_attention_logit: bool = False
    """Log the largest pre-softmax attention logit of the model each step (no clipping)."""

    test_mode: bool = False
    """Run real-time tests."""

    calculate_per_token_loss: bool = False
    """Average the loss over the real (non-padded) tokens of the global batch."""

    multi_latent_attention: bool = False
    """Use multi-latent attention (see MLATransformerConfig)."""

    no_rope_freq: Optional[Union[int, List[int]]] = None
    """Which layers skip RoPE (NoPE layers): N skips it in every N-th layer (num_layers must be a
    multiple of N; resolved to the list), or a list with one entry per layer, 1 = skip."""

    ####################
    # initialization
    ####################
    init_method: Optional[Callable] = None
    """Weight init (in place); None means N(0, init_method_std^2). Biases are always zero."""

    output_layer_init_method: Optional[Callable] = None
    """Init of attention/MLP output projections; None means N(0, (init_method_std/sqrt(2L))^2)."""

    init_method_std: float = 0.02
    """Std of the default init methods."""

    embedding_init_method: Optional[Callable] = None
    """Init of the embedding; None means N(0, embedding_init_method_std^2) (or init_method)."""

    embedding_init_method_std: Optional[float] = None
    """Std of the default embedding init; None means init_method_std."""

    init_model_with_meta_device: bool = False
    """Build the components (embedding, layers, final norm, output layer, MTP layers) on the meta
    device, without memory or values; FSDP then allocates each rank's shards and fills them by
    building the components again one at a time (init_rng.rebuild). Needs FSDP."""

    ####################
    # mixed-precision
    ####################
    apply_query_key_layer_scaling: bool = False
    """Scale QK^T by 1/layer_number (undone in the fp32 softmax); needs attention_softmax_in_fp32."""

    attention_softmax_in_fp32: bool = True
    """Run attention masking and softmax in fp32."""

    disable_bf16_reduced_precision_matmul: bool = False
    """Forbid reduced-precision accumulation in bf16 matmuls."""

    ####################
    # fusion
    ####################
    bias_activation_fusion: bool = False
    """Fuse bias add and activation (torch.compile of the plain function, see teratron/fusions.py)."""

    masked_softmax_fusion: bool = False
    """Fuse masking and softmax."""

    persist_layer_norm: bool = False
    """Persistent fused LayerNorm kernel."""

    memory_efficient_layer_norm: bool = False
    """Apex memory-efficient LayerNorm."""

    bias_dropout_fusion: bool = False
    """Fuse bias add, dropout and residual add (torch.compile, see teratron/fusions.py)."""

    apply_rope_fusion: bool = False
    """Fused RoPE kernel (torch.compile, see teratron/fusions.py)."""

    use_fused_weighted_squared_relu: bool = False
    """Fused weighted squared-ReLU kernel (MoE)."""

    fused_single_qkv_rope: bool = False
    """Apply RoPE without splitting the fused QKV."""

    ####################
    # activation recomputation
    ####################
    recompute_granularity: Optional[str] = None
    """None (save everything), 'selective' (recompute recompute_modules) or 'full' (whole layers)."""

    recompute_method: Optional[str] = None
    """With 'full': 'uniform' (chunks of recompute_num_layers) or 'block' (first N layers per stage)."""

    recompute_num_layers: Optional[int] = None
    """With 'full': layers per chunk ('uniform') or per stage ('block'); None for 'selective'."""

    distribute_saved_activations: Optional[bool] = None
    """Split the checkpointed inputs over the TP group."""

    recompute_modules: Optional[List[str]] = None
    """With 'selective': submodules to recompute; None means ["core_attn"]."""

    fine_grained_activation_offloading: bool = False
    """Copy what the `offload_modules` save for backward to host memory (docs/performance.md)."""

    offload_modules: Optional[List[str]] = None
    """With fine_grained_activation_offloading: submodules whose saved tensors go to the host
    (OFFLOAD_MODULES in transformer.activation_offload); None means none."""

    min_offloaded_tensor_size: int = 1024 * 1024
    """With fine_grained_activation_offloading: storages of fewer elements stay on the device."""

    ####################
    # fp8 / fp4
    ####################
    fp8: Optional[str] = None
    """FP8 format: 'e4m3' or 'hybrid'."""

    fp8_recipe: Optional[str] = "delayed"
    """FP8 scaling recipe."""

    fp8_param: bool = False
    """Keep parameters in FP8."""

    fp8_quantizer_factory: Optional[str] = None
    """Import path of a custom FP8 quantizer factory."""

    fp8_margin: int = 0
    """Margin of the FP8 scaling factor."""

    fp8_interval: int = 1
    """Deprecated: FP8 scaling-factor update interval."""

    fp8_amax_history_len: int = 1
    """Length of the FP8 amax history."""

    fp8_amax_compute_algo: str = "most_recent"
    """How amax is picked from the history: 'most_recent' or 'max'."""

    fp8_wgrad: bool = True
    """Compute weight gradients in FP8."""

    fp8_dot_product_attention: bool = False
    """FP8 dot-product attention."""

    fp8_multi_head_attention: bool = False
    """FP8 multi-head attention."""

    tp_only_amax_red: bool = False
    """Reduce FP8 amax only over TP (or TP-CP)."""

    first_last_layers_bf16: bool = False
    """Keep the first and last layers in bf16 under FP8."""

    num_layers_at_start_in_bf16: int = 1
    """Leading layers kept in bf16 with first_last_layers_bf16."""

    num_layers_at_end_in_bf16: int = 1
    """Trailing layers kept in bf16 with first_last_layers_bf16."""

    use_kitchen: bool = False
    """Kitchen quantization extension."""

    use_kitchen_attention: bool = False
    """Kitchen attention."""

    kitchen_attention_backend: Literal["sdpa", "fa"] = "sdpa"
    """Kitchen attention backend."""

    fp4: Optional[str] = None
    """FP4 format ('nvfp4')."""

    fp4_recipe: Optional[str] = "nvfp4"
    """FP4 recipe."""

    fp4_param: bool = False
    """Keep parameters in FP4."""

    fp4_quantizer_factory: Optional[str] = None
    """Import path of a custom FP4 quantizer factory."""

    ####################
    # MoE
    ####################
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Total FFN size of the shared experts; None means no shared expert."""

    moe_shared_expert_overlap: bool = False
    """Overlap shared-expert compute with dispatch communication (alltoall/flex only)."""

    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x . w_gate), a learned [1, h] weight
    (Qwen2-MoE's shared expert gate)."""

    moe_layer_freq: Union[int, List[int]] = 1
    """MoE layer pattern: every N-th layer is MoE, or a 0/1 list with one entry per layer."""

    moe_ffn_hidden_size: Optional[int] = None
    """Expert FFN size; None means ffn_hidden_size."""

    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    """'aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn', 'none', or a list of them."""

    moe_router_topk: int = 2
    """Experts per token."""

    moe_router_topk_limited_devices: Optional[int] = None
    """Deprecated: EP ranks per token (use moe_router_num_groups / moe_router_group_topk)."""

    moe_router_padding_for_quantization: Optional[bool] = False
    """Pad the routing map so expert token counts suit FP8/FP4 GEMMs."""

    moe_router_padding_for_fp8: Optional[bool] = False
    """Alias of moe_router_padding_for_quantization."""

    moe_router_num_groups: Optional[int] = None
    """Expert groups for group-limited routing."""

    moe_router_group_topk: Optional[int] = None
    """Groups selected per token in group-limited routing."""

    moe_router_pre_softmax: bool = False
    """Softmax (or sigmoid) before top-k instead of after."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """Scale of the top-k routing scores (with pre-softmax)."""

    moe_router_score_function: str = "softmax"
    """'softmax' or 'sigmoid'."""

    moe_router_dtype: Optional[str] = None
    """Routing dtype: None, 'fp32' or 'fp64'."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing with a dynamic per-expert bias (needs sigmoid scores)."""

    moe_router_bias_update_rate: float = 1e-3
    """Update rate of the expert bias."""

    moe_router_quantile_balancing_ema: float = 0.0
    """teratron: EMA weight of the previous step's quantile-balancing bias (0 = use this step's
    estimate only); see docs/moe.md."""

    moe_router_force_load_balancing: bool = False
    """Benchmarking: route with random logits."""

    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM."""

    moe_use_legacy_grouped_gemm: bool = False
    """Legacy GroupedMLP."""

    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    """Aux-loss coefficient(s), one per load-balancing type."""

    moe_z_loss_coeff: Optional[float] = None
    """Router z-loss coefficient."""

    moe_input_jitter_eps: Optional[float] = None
    """Multiplicative input jitter of the router."""

    moe_token_dropping: bool = False
    """Legacy token dropping switch (keep False)."""

    moe_token_dispatcher_type: str = "allgather"
    """'allgather', 'alltoall' or 'flex'."""

    moe_enable_deepep: bool = False
    """Deprecated: DeepEP dispatch (use the flex dispatcher)."""

    moe_flex_dispatcher_backend: str = "deepep"
    """Backend of the flex dispatcher: 'deepep' or 'hybridep'."""

    moe_per_layer_logging: bool = False
    """Log MoE losses per layer."""

    moe_expert_capacity_factor: Optional[float] = None
    """Expert capacity factor; None (or negative) means dropless."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (needs moe_expert_capacity_factor)."""

    moe_token_drop_policy: str = "probs"
    """Which tokens to drop over capacity: 'probs' (lowest) or 'position' (last)."""

    moe_layer_recompute: bool = False
    """Deprecated: recompute the MoE layer (same as selective recompute of 'moe')."""

    moe_permute_fusion: bool = False
    """Fused token permutation."""

    moe_router_fusion: bool = False
    """Fused routing and aux loss."""

    moe_apply_probs_on_input: bool = False
    """Multiply routing probabilities into the expert input instead of its output."""

    moe_latent_size: Optional[int] = None
    """Latent projection size of the experts; None means none."""

    moe_deepep_num_sms: int = 20
    """SMs used by DeepEP."""

    moe_hybridep_num_sms: int = 16
    """SMs used by HybridEP."""

    ####################
    # context parallel
    ####################
    cp_comm_type: Optional[Union[str, List[str]]] = None
    """Context-parallel attention communication: 'p2p', 'all_gather', 'a2a', 'a2a+p2p'."""

    ####################
    # CUDA graphs
    ####################
    enable_cuda_graph: bool = False
    """Deprecated: sets cuda_graph_impl='local'."""

    cuda_graph_use_single_mempool: bool = False
    """Megatron's single pool for all graphs, used once per step; teratron accepts it without
    pipeline parallelism (where each block's one capture is reused anyway) and refuses it with."""

    cuda_graph_retain_backward_graph: bool = False
    """Capture the backward graphs with retain_graph=True."""

    cuda_graph_warmup_steps: int = 3
    """Eager training steps before the CUDA graphs are captured."""

    external_cuda_graph: bool = False
    """Deprecated: means cuda_graph_impl='transformer_engine' (refused: no Transformer Engine)."""

    cuda_graph_impl: str = "none"
    """'none', 'local' (teratron's own capture, `transformer.cuda_graphs`) or 'transformer_engine'
    (refused: no Transformer Engine)."""

    cuda_graph_scope: str = "full"
    """With 'local': 'full' captures each transformer layer, 'full_iteration' the forward and
    backward of all micro-batches of a step (`training.full_iteration_graph`)."""

    ####################
    # miscellaneous
    ####################
    clone_scatter_output_in_embedding: bool = True
    """Clone the SP-scattered embedding output so the full input can be freed."""

    disable_parameter_transpose_cache: bool = False
    """Do not cache parameter transposes between iterations."""

    config_logger_dir: str = ""
    """When non-empty, `teratron train` writes the run's configuration there (training/config_logger.py)."""

    flash_decode: bool = False
    """Flash-decoding kernel at inference."""

    batch_invariant_mode: bool = False
    """A token's forward result does not depend on the rest of the batch: every linear layer's and
    expert's GEMM runs in fixed-shape row tiles (tensor_parallel/batch_invariant.py)."""

    use_te_activation_func: bool = False
    """Transformer Engine activation functions."""

    inference_rng_tracker: bool = False
    """A separate RNG tracker for inference."""

    inference_sampling_seed: int = 42
    """Sampling seed at inference."""

    symmetric_ar_type: Optional[str] = None
    """Symmetric-memory all-reduce variant."""

    use_inference_optimized_layers: bool = False
    """Inference-optimised layers."""

    mrope_section: Optional[List[int]] = None
    """Multimodal RoPE channel split (temporal, height, width)."""

    is_hybrid_model: bool = False
    """Hybrid model: layers of the kinds `hybrid_layer_pattern` lists (set with the pattern)."""

    hybrid_layer_pattern: Optional[str] = None
    """teratron's field for Megatron's HybridModel argument: one symbol per layer, M Mamba-2,
    G Gated DeltaNet, * attention, - MLP, E MoE (`models.hybrid.hybrid_layer_allocation`); its
    length is num_layers. None: a GPT model (every layer attention + MLP)."""

    mamba_state_dim: int = 128
    """Mamba state size."""

    mamba_head_dim: int = 64
    """Mamba head size."""

    mamba_num_groups: int = 8
    """Mamba groups."""

    mamba_num_heads: Optional[int] = None
    """Mamba heads; None derives them from hidden_size (2 x hidden_size / mamba_head_dim; resolved to that
    value with gdp_layers, whose Megatron mixer needs it given)."""

    use_mamba_mem_eff_path: bool = True
    """Memory-efficient Mamba path."""

    gdp_num_householder: int = 3
    """Gated Delta Product: rank-one updates of the state per token (Householder substeps)."""

    gdp_layers: bool = False
    """The hybrid pattern's M layers are Gated Delta Product mixers (`teratron.ssm.gated_delta_product`,
    Megatron's `--spec megatron.core.models.hybrid.hybrid_layer_specs gdp_stack_spec`), sized by the
    mamba_* fields; False: Mamba-2 mixers."""

    linear_conv_kernel_dim: int = 4
    """Gated DeltaNet: taps of the short causal convolution over q, k and v."""

    linear_key_head_dim: int = 128
    """Gated DeltaNet: channels of each query and key head."""

    linear_value_head_dim: int = 128
    """Gated DeltaNet: channels of each value and output-gate head."""

    linear_num_key_heads: int = 16
    """Gated DeltaNet: query and key heads."""

    linear_num_value_heads: int = 32
    """Gated DeltaNet: value heads, a multiple of linear_num_key_heads (each key head serves a group)."""

    mlp_chunks_for_prefill: int = 1
    """Sequence chunks of the MLP during prefill."""

    heterogeneous_block_specs: bool = False
    """Heterogeneous layers (nemotron-nas)."""

    hetereogenous_dist_checkpoint: bool = False
    """Heterogeneous layers in distributed checkpoints (Megatron's spelling)."""

    quant_recipe: Optional[object] = None
    """Per-module quantization recipe."""

    transformer_impl: str = "transformer_engine"
    """'transformer_engine' or 'local'; in teratron both build teratron's own layers."""

    def __post_init__(self):
        super().__post_init__()
        check_unsupported(self, UNSUPPORTED, ALSO_SUPPORTED)
        self._check_shapes()
        self._check_gated_delta_net()
        self._resolve_defaults()
        self._check_attention()
        self._check_recompute()
        self._check_offloading()
        self._check_attention_variants()
        self._check_context_parallel()
        self._check_qk_clip()
        self._set_init_methods()
        self._check_moe()
        check_fp8_config(self)
        if self.batch_invariant_mode and self.fp8:
            raise NotImplementedError("batch_invariant_mode with fp8: FP8 scales come from the whole batch's "
                                      "amax; drop one")
        check_cuda_graph_config(self)
        validate_pipeline_config(self)
        self._check_mtp()
        self._check_hybrid()

    def _check_hybrid(self):
        """A hybrid model's layer kinds against the other fields; its symbols and length are checked
        with the model (`GPTModelConfig`, `models.hybrid`), which owns the pattern's grammar."""
        _check_positive_int(self, "gdp_num_householder")
        if self.hybrid_layer_pattern is None:
            if self.gdp_layers:
                raise ValueError("gdp_layers without hybrid_layer_pattern: Gated Delta Product mixers are the "
                                 "pattern's M layers; give --hybrid-layer-pattern (e.g. 'M-M*-')")
            if self.is_hybrid_model:
                raise ValueError("is_hybrid_model without hybrid_layer_pattern; give the layers with "
                                 "--hybrid-layer-pattern (e.g. 'M-M*-')")
            return
        self.is_hybrid_model = True
        if self.gdp_layers and self.mamba_num_heads is None:
            # Megatron's GDP mixer has no default head count: resolved (Mamba-2's, ssm.mamba_mixer.mamba_num_heads)
            # so that checkpoints record it
            self.mamba_num_heads = 2 * self.hidden_size // self.mamba_head_dim
        if "|" in self.hybrid_layer_pattern:
            raise ValueError("hybrid_layer_pattern holds the layers only; a pattern with '|' is split into "
                             "stages by the run (--hybrid-layer-pattern), or set pipeline_model_parallel_layout")
        has_moe = "E" in self.hybrid_layer_pattern
        if has_moe != (self.num_moe_experts is not None):
            raise ValueError("hybrid_layer_pattern has MoE layers (E) but num_moe_experts is not set; set --num-experts"
                             if has_moe else "num_moe_experts is set but hybrid_layer_pattern has no MoE layer (E); "
                             "put E layers in the pattern or drop --num-experts")
        if self.moe_layer_freq != 1:
            raise ValueError("moe_layer_freq with hybrid_layer_pattern: the pattern places the MoE layers (E); drop "
                             "--moe-layer-freq")
        if ("+" in self.hybrid_layer_pattern) != self.multi_latent_attention:
            raise ValueError("hybrid_layer_pattern has multi-latent attention layers (+) but multi_latent_attention "
                             "is off; give --multi-latent-attention and its sizes" if "+" in self.hybrid_layer_pattern
                             else "multi_latent_attention with hybrid_layer_pattern: multi-latent attention layers "
                             "are '+'; put them in the pattern or drop --multi-latent-attention")
        if "*" in self.hybrid_layer_pattern and self.multi_latent_attention:
            raise ValueError("hybrid_layer_pattern has standard attention layers (*) next to multi-latent attention "
                             "(+): one model takes one kind (Megatron would run '*' without RoPE); use '+' only")
        depths = self.hybrid_layer_pattern.count("/")
        if (self.mtp_num_layers or 0) != depths:
            raise ValueError(f"mtp_num_layers is {self.mtp_num_layers} but hybrid_layer_pattern has {depths} "
                             "multi-token-prediction depths after '/'; a hybrid model's MTP depths come from the "
                             "pattern (e.g. 'M*M*/M-/M-')")

    def _check_shapes(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}; set {name}")
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"tensor_model_parallel_size ({tp}); choose a head count that TP splits evenly"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); change one of them or set kv_channels"
            )
        if self.num_query_groups is not None:
            if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups:
                raise ValueError(
                    f"num_query_groups ({self.num_query_groups}) must divide num_attention_heads "
                    f"({self.num_attention_heads})"
                )
            if self.num_query_groups % tp:
                raise ValueError(
                    f"num_query_groups ({self.num_query_groups}) is not divisible by "
                    f"tensor_model_parallel_size ({tp}); use a multiple of the TP size"
                )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("ffn_hidden_size", "kv_channels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.softmax_scale is not None and self.softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be positive or None, got {self.softmax_scale!r}")

    def _check_gated_delta_net(self):
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads"):
            _check_positive_int(self, name)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads}): each key head serves a group")

    def _resolve_defaults(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.activation_func is None:
            self.activation_func = F.gelu
        if self.attention_backend is None:
            self.attention_backend = AttnBackend.auto
        elif isinstance(self.attention_backend, str):
            if self.attention_backend not in AttnBackend.__members__:
                raise ValueError(
                    f"attention_backend={self.attention_backend!r} is not one of "
                    f"{list(AttnBackend.__members__)}"
                )
            self.attention_backend = AttnBackend[self.attention_backend]
        if self.fp32_residual_connection:
            # The residual stream is what flows between pipeline stages.
            self.pipeline_dtype = torch.float32

    def _check_attention(self):
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization={self.normalization!r} is not supported; use 'LayerNorm' or 'RMSNorm'"
            )
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(
                f"transformer_impl={self.transformer_impl!r} is not supported; use 'local' or "
                "'transformer_engine' (both build teratron's own layers)"
            )
        if not isinstance(self.attention_backend, AttnBackend):
            raise ValueError(
                f"attention_backend={self.attention_backend!r} must be an AttnBackend or one of "
                f"{list(AttnBackend.__members__)}"
            )
        if self.apply_query_key_layer_scaling and not self.attention_softmax_in_fp32:
            raise ValueError(
                "apply_query_key_layer_scaling needs attention_softmax_in_fp32=True; set it or turn "
                "off apply_query_key_layer_scaling"
            )
        if self.multi_latent_attention and self.rotary_interleaved:
            raise ValueError(
                "rotary_interleaved does not work with multi_latent_attention; set it to False"
            )

    def _check_attention_variants(self):
        """Sliding windows, attention sinks, NoPE layers, YaRN and the clamped GLU."""
        if self.window_size is not None:
            window = self.window_size
            if (not isinstance(window, (tuple, list)) or len(window) != 2
                    or any(type(w) is not int or w < -1 for w in window)):
                raise ValueError(f"window_size={window!r} must be two ints (left, right), each >= 0 or -1 "
                                 "(unbounded), e.g. (4096, 0)")
            self.window_size = tuple(window)
        elif self.window_attn_skip_freq is not None:
            raise ValueError("window_attn_skip_freq is set but window_size is None; set window_size")
        self.window_attn_skip_freq = self._check_layer_pattern("window_attn_skip_freq", divides=False)
        self.no_rope_freq = self._check_layer_pattern("no_rope_freq", divides=True)
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"softmax_type={self.softmax_type!r} is not valid; use 'vanilla', 'off-by-one' "
                             "or 'learnable'")
        for name in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                     "yarn_beta_slow"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        clamp = self.activation_func_clamp_value
        if clamp is not None:
            if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not 0 < clamp < float("inf"):
                raise ValueError(f"activation_func_clamp_value={clamp!r} must be a finite number > 0 or None")
            if not self.gated_linear_unit:
                raise ValueError("activation_func_clamp_value clamps a gated MLP's fc1 output; set "
                                 "gated_linear_unit (--swiglu) or leave activation_func_clamp_value None")

    def _check_context_parallel(self):
        """cp_comm_type: one of CP_COMM_TYPES or one per layer; what each type needs."""
        from teratron.transformer.context_parallel import CP_COMM_TYPES, EXCHANGED

        value = self.cp_comm_type
        types = [value] if value is None or isinstance(value, str) else list(value)
        if not isinstance(value, (str, list, tuple, type(None))) or (
                not isinstance(value, str) and value is not None and len(types) != self.num_layers):
            raise ValueError(f"cp_comm_type={value!r} must be one of {CP_COMM_TYPES} or a list of them, one per layer "
                             f"({self.num_layers})")
        if any(t not in (None, *CP_COMM_TYPES) for t in types):
            raise ValueError(f"cp_comm_type={value!r}: use {', '.join(CP_COMM_TYPES)} (or one per layer)")
        if not isinstance(value, (str, type(None))):
            self.cp_comm_type = types
        cp = self.context_parallel_size
        if cp == 1:
            return
        used = {t or "p2p" for t in types}
        hierarchical = self.hierarchical_context_parallel_sizes
        if "a2a+p2p" in used and (hierarchical is None or len(hierarchical) != 2):
            raise ValueError(f"cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes of two levels (a2a "
                             f"size, p2p size) multiplying to context_parallel_size={cp}, got {hierarchical!r}")
        heads = self.num_attention_heads // self.tensor_model_parallel_size
        for comm_type, size in (("a2a", cp), ("a2a+p2p", (hierarchical or [cp])[0])):
            if comm_type in used and heads % size:
                raise ValueError(f"cp_comm_type {comm_type!r} splits the {heads} attention heads of each "
                                 f"tensor-parallel rank over {size} context-parallel ranks; choose sizes that divide "
                                 "them or another cp_comm_type")
        if self.attention_dropout > 0 and used & set(EXCHANGED):
            raise ValueError(f"attention_dropout={self.attention_dropout} with context_parallel_size={cp} "
                             f"(cp_comm_type {sorted(used & set(EXCHANGED))}): context-parallel attention has no "
                             "dropout; set attention_dropout to 0 or use cp_comm_type 'a2a'")
        if self.cuda_graph_impl == "local" or self.enable_cuda_graph:
            raise ValueError(f"context_parallel_size={cp} with CUDA graphs: the attention exchange is not captured; "
                             "set cuda_graph_impl to 'none'")
    def _check_qk_clip(self):
        for name in ("qk_clip_alpha", "qk_clip_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}={value!r} must be a number")
        if not 0.0 < self.qk_clip_alpha < 1.0:
            raise ValueError(f"qk_clip_alpha={self.qk_clip_alpha} must be in (0, 1): queries scale by eta ** alpha, "
                             "keys by eta ** (1 - alpha)")
        if not 0.0 < self.qk_clip_threshold < float("inf"):
            raise ValueError(f"qk_clip_threshold={self.qk_clip_threshold} must be a finite number > 0 (the largest "
                             "attention logit a head keeps)")
        if not self.qk_clip and (self.qk_clip_alpha != 0.5 or self.qk_clip_threshold != 100):
            raise ValueError("qk_clip_alpha or qk_clip_threshold is set but qk_clip is off; turn on qk_clip or "
                             "leave them at their defaults")
        if self.attention_output_gate and self.multi_latent_attention:
            raise NotImplementedError("attention_output_gate with multi_latent_attention is not supported yet; "
                                      "gated attention is grouped-query attention's")
        if self.qk_clip and self.qk_layernorm and not self.multi_latent_attention:
            raise ValueError("qk_clip with qk_layernorm: the per-head norms undo any scaling of the query and key "
                             "weights, so the clip would do nothing; turn one of them off")

    def _check_layer_pattern(self, name: str, divides: bool):
        """A per-layer pattern field (None, an int N >= 1, or one 0/1 per layer); with `divides`
        an int must divide num_layers and becomes the list [0]*(N-1)+[1] repeated (Megatron's
        no_rope_freq). Returns the checked value."""
        value = getattr(self, name)
        if value is None:
            return None
        if type(value) is int:
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1 (or a 0/1 list with one entry per layer)")
            if not divides:
                return value
            if self.num_layers % value:
                raise ValueError(f"{name}={value} must divide num_layers ({self.num_layers}); or give a 0/1 "
                                 "list with one entry per layer")
            return ([0] * (value - 1) + [1]) * (self.num_layers // value)
        if (not isinstance(value, (list, tuple)) or len(value) != self.num_layers
                or any(v not in (0, 1) or isinstance(v, float) for v in value)):
            raise ValueError(f"{name}={value!r} must be an int >= 1 or a list of 0/1 with one entry per layer "
                             f"({self.num_layers})")
        return [int(v) for v in value]

    def _check_recompute(self):
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        self.recompute_modules = list(self.recompute_modules)
        if self.moe_layer_recompute:
            warnings.warn("moe_layer_recompute is deprecated; use recompute_granularity='selective' "
                          "with 'moe' in recompute_modules")
            if self.recompute_granularity == "full":
                raise ValueError(
                    "moe_layer_recompute cannot be combined with recompute_granularity='full'"
                )
            self.recompute_granularity = "selective"
            if "moe" not in self.recompute_modules:
                self.recompute_modules.append("moe")
        granularity = self.recompute_granularity
        if granularity not in (None, "full", "selective"):
            raise ValueError(
                f"recompute_granularity={granularity!r} is not valid; use None, 'full' or 'selective'"
            )
        invalid = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if invalid:
            raise ValueError(
                f"recompute_modules has unknown entries {invalid}; choose from {list(RECOMPUTE_MODULES)}"
            )
        if self.recompute_method is not None:
            if self.recompute_method not in ("uniform", "block"):
                raise ValueError(
                    f"recompute_method={self.recompute_method!r} is not valid; use 'uniform' or 'block'"
                )
            if granularity != "full":
                raise ValueError(
                    f"recompute_method is only used with recompute_granularity='full' (got "
                    f"{granularity!r}); set recompute_method=None"
                )
        if self.recompute_num_layers is not None and granularity != "full":
            raise ValueError(
                f"recompute_num_layers is only used with recompute_granularity='full' (got "
                f"{granularity!r}); set recompute_num_layers=None"
            )
        if granularity == "full":
            if self.recompute_method is None:
                raise ValueError(
                    "recompute_granularity='full' needs recompute_method: 'uniform' or 'block'"
                )
            n = self.recompute_num_layers
            if n is None or not 1 <= n <= self.num_layers:
                raise ValueError(
                    f"recompute_granularity='full' needs recompute_num_layers between 1 and "
                    f"num_layers ({self.num_layers}), got {self.recompute_num_layers!r}"
                )
        if granularity == "selective":
            for module in self.recompute_modules:
                if module not in SUPPORTED_RECOMPUTE_MODULES:
                    raise NotImplementedError(
                        f"recompute_modules contains {module!r}: recomputing it is not supported yet; "
                        f"use {list(SUPPORTED_RECOMPUTE_MODULES)}"
                    )
            if "mla_up_proj" in self.recompute_modules and not self.multi_latent_attention:
                raise ValueError("recompute_modules contains 'mla_up_proj' but multi_latent_attention is False; "
                                 "drop it (it recomputes MLA's up projections)")

    def _check_offloading(self):
        from teratron.transformer.activation_offload import OFFLOAD_MODULES

        self.offload_modules = list(self.offload_modules or [])
        invalid = [m for m in self.offload_modules if m not in OFFLOAD_MODULES]
        if invalid:
            raise ValueError(f"offload_modules has unknown entries {invalid}; choose from {list(OFFLOAD_MODULES)}")
        if self.fine_grained_activation_offloading and not self.offload_modules:
            raise ValueError("fine_grained_activation_offloading needs offload_modules; choose from "
                             f"{list(OFFLOAD_MODULES)}")
        if self.offload_modules and not self.fine_grained_activation_offloading:
            raise ValueError(f"offload_modules {self.offload_modules} is set but fine_grained_activation_offloading "
                             "is False; set it to True or leave offload_modules empty")
        if not isinstance(self.min_offloaded_tensor_size, int) or self.min_offloaded_tensor_size < 0:
            raise ValueError(f"min_offloaded_tensor_size must be a non-negative integer, got "
                             f"{self.min_offloaded_tensor_size!r}")

    def _set_init_methods(self):
        if self.init_method_std <= 0:
            raise ValueError(f"init_method_std must be positive, got {self.init_method_std!r}")
        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method is None:
            if self.init_method is None or self.embedding_init_method_std != self.init_method_std:
                self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
            else:
                self.embedding_init_method = self.init_method
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, self.num_layers
            )

    def _check_moe(self):
        experts = self.num_moe_experts
        if experts is None:
            if self.expert_model_parallel_size > 1:
                raise ValueError(
                    f"expert_model_parallel_size={self.expert_model_parallel_size} needs "
                    "num_moe_experts; set num_moe_experts or expert_model_parallel_size=1"
                )
            if self.moe_ffn_hidden_size is not None:
                raise ValueError(
                    "moe_ffn_hidden_size is set but num_moe_experts is None; set num_moe_experts"
                )
            return
        if experts < 1:
            raise ValueError(f"num_moe_experts must be a positive integer or None, got {experts!r}")
        if experts % self.expert_model_parallel_size:
            raise ValueError(
                f"num_moe_experts ({experts}) is not divisible by expert_model_parallel_size "
                f"({self.expert_model_parallel_size})"
            )
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.add_bias_linear and self.expert_tensor_parallel_size > 1:
            raise ValueError(
                "MoE experts with add_bias_linear=True need expert_tensor_parallel_size=1; set "
                "add_bias_linear=False or expert_tensor_parallel_size=1"
            )
        self._check_moe_layer_freq()
        self._check_moe_router()
        self._check_moe_dispatch()

    def _check_mtp(self):
        depths = self.mtp_num_layers
        if depths is None:
            for name in ("mtp_loss_scaling_factor", "freeze_base_model_for_mtp"):
                if getattr(self, name):
                    raise ValueError(f"{name} is set but mtp_num_layers is None; set mtp_num_layers")
            return
        if not isinstance(depths, int) or isinstance(depths, bool) or depths < 1:
            raise ValueError(f"mtp_num_layers must be a positive integer or None, got {depths!r}")
        if self.mtp_loss_scaling_factor is None:
            self.mtp_loss_scaling_factor = 0.1
        if self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"mtp_loss_scaling_factor must be >= 0, got {self.mtp_loss_scaling_factor}")
        unsupported = [("fp8", self.fp8 is not None, "FP8"),
                       ("cuda_graph_impl", self.cuda_graph_impl == "local", "local CUDA graphs")]
        for name, used, what in unsupported:
            if used:
                raise NotImplementedError(f"mtp_num_layers with {name}={getattr(self, name)!r}: multi-token "
                                          f"prediction is not built for {what} yet; drop one")
        if self.freeze_base_model_for_mtp and self.pipeline_model_parallel_size > 1:
            raise NotImplementedError("freeze_base_model_for_mtp needs pipeline_model_parallel_size 1: the "
                                      "stages before the MTP layers would have nothing to train")

    def _check_moe_layer_freq(self):
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            if freq < 1:
                raise ValueError(f"moe_layer_freq must be >= 1, got {freq}")
        elif isinstance(freq, list):
            if len(freq) != self.num_layers or any(f not in (0, 1) for f in freq):
                raise ValueError(
                    f"moe_layer_freq as a list needs one 0/1 entry per layer ({self.num_layers}), "
                    f"got {freq}"
                )
        else:
            raise ValueError(f"moe_layer_freq must be an int or a list of 0/1, got {freq!r}")

    def _check_moe_router(self):
        experts, topk = self.num_moe_experts, self.moe_router_topk
        if not 1 <= topk <= experts:
            raise ValueError(
                f"moe_router_topk ({topk}) must be between 1 and num_moe_experts ({experts})"
            )
        balancing = self.moe_router_load_balancing_type
        balancing_list = balancing if isinstance(balancing, list) else [balancing]
        for kind in balancing_list:
            if kind not in LOAD_BALANCING_TYPES:
                raise ValueError(
                    f"moe_router_load_balancing_type {kind!r} is not one of {list(LOAD_BALANCING_TYPES)}"
                )
        if isinstance(balancing, list) and not (
            isinstance(self.moe_aux_loss_coeff, list) and len(self.moe_aux_loss_coeff) == len(balancing)
        ):
            coeffs = self.moe_aux_loss_coeff
            raise ValueError(
                f"moe_router_load_balancing_type has {len(balancing)} value(s) but moe_aux_loss_coeff "
                f"{len(coeffs) if isinstance(coeffs, list) else 1}; give one coefficient per type"
            )
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(
                f"moe_router_score_function={self.moe_router_score_function!r}; "
                "use 'softmax' or 'sigmoid'"
            )
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"moe_router_dtype={self.moe_router_dtype!r}; use None, 'fp32' or 'fp64'")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid'")
        if (topk == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax
                and balancing != "sinkhorn"):
            # softmax over a single selected logit is constant: the router would get no gradient.
            raise ValueError("moe_router_topk=1 with softmax scores needs moe_router_pre_softmax=True")
        if self.moe_router_topk_limited_devices:
            if self.moe_router_group_topk:
                raise ValueError(
                    "moe_router_topk_limited_devices is deprecated and replaced by "
                    "moe_router_group_topk; set only moe_router_group_topk and moe_router_num_groups"
                )
            warnings.warn("moe_router_topk_limited_devices is deprecated; use moe_router_group_topk "
                          "and moe_router_num_groups")
            self.moe_router_group_topk = self.moe_router_topk_limited_devices
            self.moe_router_num_groups = self.expert_model_parallel_size
            # Migrated: clear it so dataclasses.replace (which re-runs this) does not see both.
            self.moe_router_topk_limited_devices = None
        if self.moe_router_group_topk:
            groups = self.moe_router_num_groups
            if not groups:
                raise ValueError("moe_router_group_topk needs moe_router_num_groups")
            if experts % groups:
                raise ValueError(
                    f"num_moe_experts ({experts}) is not divisible by moe_router_num_groups ({groups})"
                )
            if self.moe_router_group_topk > groups:
                raise ValueError(
                    f"moe_router_group_topk ({self.moe_router_group_topk}) exceeds "
                    f"moe_router_num_groups ({groups})"
                )
        if self.moe_router_padding_for_fp8:
            self.moe_router_padding_for_quantization = True
        if self.moe_router_padding_for_quantization:
            raise ValueError(
                "moe_router_padding_for_quantization needs fp8 or fp4, which are not supported yet"
            )

    def _check_moe_dispatch(self):
        dispatcher = self.moe_token_dispatcher_type
        if dispatcher not in ("allgather", "alltoall", "flex"):
            raise ValueError(
                f"moe_token_dispatcher_type={dispatcher!r} is not valid; use 'allgather' or 'alltoall'"
            )
        if dispatcher == "flex":
            raise NotImplementedError(
                "moe_token_dispatcher_type='flex': the flex dispatcher (DeepEP/HybridEP) is not "
                "supported yet; use 'allgather' or 'alltoall'"
            )
        if dispatcher == "allgather" and self.variable_seq_lengths:
            raise ValueError(
                "moe_token_dispatcher_type='allgather' does not support variable_seq_lengths; "
                "use 'alltoall'"
            )
        if self.moe_expert_capacity_factor is not None:
            if self.moe_expert_capacity_factor < 0:
                self.moe_expert_capacity_factor = None
            else:
                balancing = self.moe_router_load_balancing_type
                for kind in balancing if isinstance(balancing, list) else [balancing]:
                    if kind == "sinkhorn":
                        raise ValueError(
                            "moe_expert_capacity_factor does not work with sinkhorn load balancing"
                        )
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
        if self.moe_token_drop_policy not in ("probs", "position"):
            raise ValueError(
                f"moe_token_drop_policy={self.moe_token_drop_policy!r}; use 'probs' or 'position'"
            )
        shared = self.moe_shared_expert_intermediate_size
        if self.moe_shared_expert_gate and shared is None:
            raise ValueError("moe_shared_expert_gate gates the shared experts; set moe_shared_expert_intermediate_size")
        if shared is not None:
            if shared < 1:
                raise ValueError(f"moe_shared_expert_intermediate_size must be positive, got {shared}")
            if self.moe_shared_expert_overlap and self.moe_token_dispatcher_type != "alltoall":
                raise ValueError("moe_shared_expert_overlap needs moe_token_dispatcher_type='alltoall'")


@dataclass
class MLATransformerConfig(TransformerConfig):
    """TransformerConfig for multi-latent attention (DeepSeek), with YaRN RoPE parameters."""

    multi_latent_attention: bool = True
    """Use multi-latent attention."""

    q_lora_rank: Optional[int] = 512
    """Rank of the low-rank query projection; None projects the queries straight from the hidden state."""

    kv_lora_rank: int = 512
    """Rank of the low-rank key/value projection."""

    qk_head_dim: int = 128
    """Per-head QK dimension without the positional part (q_head_dim = this + qk_pos_emb_head_dim)."""

    qk_pos_emb_head_dim: int = 64
    """Per-head dimension of the RoPE part of Q and K (one RoPE key shared by all heads)."""

    v_head_dim: int = 128
    """Per-head V dimension."""

    normalization: str = "RMSNorm"
    """MLA models default to RMSNorm."""

    rope_type: str = "yarn"
    """'rope' or 'yarn' (the positional part of Q and K)."""

    rotary_base: float = 10000
    """RoPE base (rope and yarn)."""

    rotary_percent: float = 1.0
    """Fraction of qk_pos_emb_head_dim rotated (rope)."""

    rotary_scaling_factor: float = 40
    """YaRN scaling factor (also scales the softmax through mscale_all_dim, as Megatron does)."""

    original_max_position_embeddings: int = 4096
    """Context length of the original model (yarn)."""

    beta_fast: float = 32
    """YaRN beta_fast."""

    beta_slow: float = 1
    """YaRN beta_slow."""

    mscale: float = 1.0
    """YaRN mscale."""

    mscale_all_dim: float = 0.0
    """YaRN mscale over all dimensions."""

    cache_mla_latents: bool = False
    """Cache the MLA latents (compressed KV and the RoPE key) instead of per-head keys and values
    at inference, attending with the up projections absorbed into the query and output."""

    def __post_init__(self):
        super().__post_init__()
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"rope_type={self.rope_type!r} is not valid; use 'rope' or 'yarn'")
        if self.q_lora_rank is not None:
            _check_positive_int(self, "q_lora_rank", " or None")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "original_max_position_embeddings"):
            _check_positive_int(self, name)
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must be even: RoPE turns channel "
                             "pairs")
        for name in ("rotary_base", "rotary_scaling_factor", "beta_fast", "beta_slow"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


def pattern_layer_number(config, layer_number: int) -> int:
    """The layer whose entry of a per-layer pattern (window_attn_skip_freq, no_rope_freq) layer
    `layer_number` (1-based, global) takes: its own, or for a multi-token-prediction layer
    (numbered past num_layers) the last decoder layer's, which it is built like."""
    return min(layer_number, config.num_layers)


def _check_positive_int(config, name: str, alternative: str = "") -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer{alternative}, got {value!r}")
