"""TransformerConfig / MLATransformerConfig: the API reference's fields and defaults, derived
values, validation errors and the not-yet-supported table."""

import dataclasses
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from teratron.model_parallel_config import ModelParallelConfig
from teratron.transformer import transformer_config as tc
from teratron.transformer.enums import AttnBackend
from teratron.transformer.transformer_config import TERATRON_EXTRA_FIELDS, MLATransformerConfig, TransformerConfig

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8)
NO_DEFAULT = object()  # the reference prints no default: a required field, or one whose default it omits

# Every field of Megatron Core's API reference for `core.transformer.transformer_config` (the project's
# seed document seeds/003_f608d2b89fa5cb49.txt, read once into these tables), in its order, with the
# default it prints.
TRANSFORMER_CONFIG_REFERENCE = dict(
    num_layers=NO_DEFAULT, mtp_num_layers=None, mtp_loss_scaling_factor=None,
    num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
    pipeline_model_parallel_layout=None, account_for_embedding_in_pipeline_split=False,
    account_for_loss_in_pipeline_split=False, hidden_size=NO_DEFAULT, num_attention_heads=NO_DEFAULT,
    attention_backend=None, softmax_scale=None, softmax_type="vanilla", num_query_groups=None,
    ffn_hidden_size=None, kv_channels=None, hidden_dropout=0.1, attention_dropout=0.1,
    fp32_residual_connection=False, apply_residual_connection_post_layernorm=False, layernorm_epsilon=1e-05,
    layernorm_zero_centered_gamma=False, add_bias_linear=True, add_qkv_bias=False, gated_linear_unit=False,
    activation_func=None, activation_func_fp8_input_store=False, glu_linear_offset=0.0,
    activation_func_clamp_value=None, num_moe_experts=None, rotary_interleaved=False, window_size=None,
    window_attn_skip_freq=None, normalization="LayerNorm", qk_layernorm=False, qk_clip=False,
    qk_clip_alpha=0.5, qk_clip_threshold=100, log_max_attention_logit=False, test_mode=False,
    calculate_per_token_loss=False, multi_latent_attention=False, no_rope_freq=None, init_method=None,
    output_layer_init_method=None, init_method_std=0.02, embedding_init_method=None,
    embedding_init_method_std=None, init_model_with_meta_device=False, apply_query_key_layer_scaling=False,
    attention_softmax_in_fp32=True, disable_bf16_reduced_precision_matmul=False, bias_activation_fusion=False,
    masked_softmax_fusion=False, persist_layer_norm=False, memory_efficient_layer_norm=False,
    bias_dropout_fusion=False, apply_rope_fusion=False, use_fused_weighted_squared_relu=False,
    fused_single_qkv_rope=False, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
    distribute_saved_activations=None, recompute_modules=None, fp8=None, fp8_recipe="delayed",
    fp8_param=False, fp8_quantizer_factory=None, fp8_margin=NO_DEFAULT, fp8_interval=NO_DEFAULT,
    fp8_amax_history_len=NO_DEFAULT, fp8_amax_compute_algo="most_recent", fp8_wgrad=True,
    fp8_dot_product_attention=False, fp8_multi_head_attention=False, tp_only_amax_red=False,
    first_last_layers_bf16=False, num_layers_at_start_in_bf16=NO_DEFAULT,
    num_layers_at_end_in_bf16=NO_DEFAULT, use_kitchen=False, use_kitchen_attention=False,
    kitchen_attention_backend="sdpa", fp4=None, fp4_recipe="nvfp4", fp4_param=False,
    fp4_quantizer_factory=None, moe_shared_expert_intermediate_size=None, moe_shared_expert_overlap=False,
    moe_layer_freq=NO_DEFAULT, moe_ffn_hidden_size=None, moe_router_load_balancing_type="aux_loss",
    moe_router_topk=NO_DEFAULT, moe_router_topk_limited_devices=None,
    moe_router_padding_for_quantization=False, moe_router_padding_for_fp8=False, moe_router_num_groups=None,
    moe_router_group_topk=None, moe_router_pre_softmax=False, moe_router_topk_scaling_factor=None,
    moe_router_score_function="softmax", moe_router_dtype=None, moe_router_enable_expert_bias=False,
    moe_router_bias_update_rate=0.001, moe_router_force_load_balancing=False, moe_grouped_gemm=False,
    moe_use_legacy_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
    moe_input_jitter_eps=None, moe_token_dropping=False, moe_token_dispatcher_type="allgather",
    moe_enable_deepep=False, moe_flex_dispatcher_backend="deepep", moe_per_layer_logging=False,
    moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False, moe_token_drop_policy="probs",
    moe_layer_recompute=False, moe_permute_fusion=False, moe_router_fusion=False,
    moe_apply_probs_on_input=False, moe_latent_size=None, moe_deepep_num_sms=NO_DEFAULT,
    moe_hybridep_num_sms=NO_DEFAULT, cp_comm_type=None, enable_cuda_graph=False,
    cuda_graph_use_single_mempool=False, cuda_graph_retain_backward_graph=False,
    cuda_graph_warmup_steps=NO_DEFAULT, external_cuda_graph=False, cuda_graph_impl="none",
    cuda_graph_scope="full", clone_scatter_output_in_embedding=True, disable_parameter_transpose_cache=False,
    config_logger_dir=NO_DEFAULT, flash_decode=False, batch_invariant_mode=False,
    use_te_activation_func=False, use_te_rng_tracker=False, inference_rng_tracker=False,
    inference_sampling_seed=NO_DEFAULT, symmetric_ar_type=None, use_inference_optimized_layers=False,
    mrope_section=None, is_hybrid_model=False, mamba_state_dim=128, mamba_head_dim=NO_DEFAULT,
    mamba_num_groups=NO_DEFAULT, mamba_num_heads=None, use_mamba_mem_eff_path=True,
    mlp_chunks_for_prefill=NO_DEFAULT, heterogeneous_block_specs=False, hetereogenous_dist_checkpoint=False,
    quant_recipe=None, transformer_impl="transformer_engine",
)
MLA_TRANSFORMER_CONFIG_REFERENCE = dict(
    multi_latent_attention=True, q_lora_rank=512, kv_lora_rank=512, qk_head_dim=128,
    qk_pos_emb_head_dim=NO_DEFAULT, v_head_dim=128, normalization="RMSNorm", rope_type="yarn",
    rotary_base=10000, rotary_percent=1.0, rotary_scaling_factor=NO_DEFAULT,
    original_max_position_embeddings=4096, beta_fast=NO_DEFAULT, beta_slow=NO_DEFAULT, mscale=1.0,
    mscale_all_dim=0.0, cache_mla_latents=False,
)


def _default(cls, name):
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    return field.default if field.default_factory is dataclasses.MISSING else field.default_factory()


@pytest.mark.parametrize("cls_name", ["TransformerConfig", "MLATransformerConfig"])
def test_every_reference_field_exists_with_its_default(cls_name):
    cls, reference = {"TransformerConfig": (TransformerConfig, TRANSFORMER_CONFIG_REFERENCE),
                      "MLATransformerConfig": (MLATransformerConfig, MLA_TRANSFORMER_CONFIG_REFERENCE)}[cls_name]
    ours = {f.name for f in dataclasses.fields(cls)}
    missing = [name for name in reference if name not in ours]
    assert not missing
    wrong = []
    for name, reference_default in reference.items():
        if reference_default is NO_DEFAULT:
            continue
        default = _default(cls, name)
        if reference_default is None or isinstance(reference_default, bool):
            ok = default is reference_default
        else:
            ok = type(default) in (int, float, str) and default == reference_default
        if not ok:
            wrong.append((name, reference_default, default))
    assert not wrong


def test_no_invented_fields():
    known = set(TRANSFORMER_CONFIG_REFERENCE) | {f.name for f in dataclasses.fields(ModelParallelConfig)}
    extra = {f.name for f in dataclasses.fields(TransformerConfig)} - known
    assert extra == set(TERATRON_EXTRA_FIELDS)


def test_megatron_defaults_missing_from_the_reference():
    # Fields the reference lists without a default: Megatron Core's values.
    expected = dict(fp8_margin=0, fp8_interval=1, fp8_amax_history_len=1, num_layers_at_start_in_bf16=1,
                    num_layers_at_end_in_bf16=1, moe_layer_freq=1, moe_router_topk=2,
                    moe_deepep_num_sms=20, moe_hybridep_num_sms=16, cuda_graph_warmup_steps=3,
                    inference_sampling_seed=42, mamba_head_dim=64, mamba_num_groups=8,
                    mlp_chunks_for_prefill=1, config_logger_dir="")
    for name, value in expected.items():
        assert _default(TransformerConfig, name) == value, name
    mla = dict(qk_pos_emb_head_dim=64, rotary_scaling_factor=40, beta_fast=32, beta_slow=1)
    for name, value in mla.items():
        assert _default(MLATransformerConfig, name) == value, name


def test_derived_values():
    c = TransformerConfig(**BASE)
    assert c.ffn_hidden_size == 4 * 64
    assert c.kv_channels == 64 // 8
    assert c.num_query_groups == 8
    assert c.activation_func is F.gelu
    assert c.attention_backend is AttnBackend.auto
    assert c.recompute_modules == ["core_attn"]
    assert c.embedding_init_method_std == c.init_method_std
    assert c.expert_tensor_parallel_size == 1
    assert c.pipeline_dtype == torch.float32 and c.autocast_dtype == torch.float32
    assert c.moe_ffn_hidden_size is None

    c = TransformerConfig(**BASE, ffn_hidden_size=100, kv_channels=16, num_query_groups=2,
                          activation_func=F.silu, gated_linear_unit=True, attention_backend="unfused")
    assert (c.ffn_hidden_size, c.kv_channels, c.num_query_groups) == (100, 16, 2)
    assert c.activation_func is F.silu and c.attention_backend is AttnBackend.unfused

    c = TransformerConfig(**BASE, num_moe_experts=4, add_bias_linear=False, tensor_model_parallel_size=2,
                          sequence_parallel=True)
    assert c.moe_ffn_hidden_size == c.ffn_hidden_size == 256
    assert c.expert_tensor_parallel_size == 2

    c = TransformerConfig(**BASE, fp32_residual_connection=True, params_dtype=torch.bfloat16, bf16=True)
    assert c.pipeline_dtype == torch.float32  # the residual stream crosses stages
    assert c.autocast_dtype == torch.bfloat16


def _std_after_init(init_method):
    torch.manual_seed(0)
    w = torch.empty(1000, 1000)
    init_method(w)
    return w.std().item()


def test_init_methods_have_the_documented_std():
    c = TransformerConfig(**BASE, init_method_std=0.05)
    assert _std_after_init(c.init_method) == pytest.approx(0.05, rel=0.02)
    assert _std_after_init(c.output_layer_init_method) == pytest.approx(0.05 / math.sqrt(2 * 4), rel=0.02)
    assert _std_after_init(c.embedding_init_method) == pytest.approx(0.05, rel=0.02)

    c = TransformerConfig(**BASE, embedding_init_method_std=1.0)
    assert _std_after_init(c.embedding_init_method) == pytest.approx(1.0, rel=0.02)
    assert _std_after_init(c.init_method) == pytest.approx(0.02, rel=0.02)

    def custom(w):
        return torch.nn.init.constant_(w, 3.0)

    c = TransformerConfig(**BASE, init_method=custom)
    assert c.embedding_init_method is custom  # same std: the embedding follows the custom init


def test_configs_compare_and_pickle():
    a, b = TransformerConfig(**BASE), TransformerConfig(**BASE)
    assert a == b
    assert pickle.loads(pickle.dumps(a)) == a
    assert a != TransformerConfig(**BASE, init_method_std=0.03)
    m = MLATransformerConfig(**BASE)
    assert m.normalization == "RMSNorm" and m.multi_latent_attention
    assert pickle.loads(pickle.dumps(m)) == m
    assert dataclasses.replace(a, hidden_dropout=0.0).ffn_hidden_size == 256


def test_calls_the_pipeline_validator(monkeypatch):
    import teratron.transformer.transformer_config as transformer_config

    seen = []
    monkeypatch.setattr(transformer_config, "validate_pipeline_config", seen.append)
    c = TransformerConfig(**BASE, pipeline_model_parallel_size=2)
    assert seen == [c]


def _build(**overrides):
    return TransformerConfig(**{**BASE, **overrides})


VALUE_ERRORS = [
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(hidden_size=-1), "hidden_size must be a positive integer"),
    (dict(num_attention_heads=0), "num_attention_heads must be a positive integer"),
    (dict(hidden_size=60, num_attention_heads=8), "hidden_size .60. is not divisible by num_attention_heads"),
    (dict(num_attention_heads=6, hidden_size=60, tensor_model_parallel_size=4), "num_attention_heads .6. is not divisible by tensor_model_parallel_size"),
    (dict(num_query_groups=3), r"num_query_groups \(3\) must divide num_attention_heads"),
    (dict(num_query_groups=2, tensor_model_parallel_size=4), "num_query_groups .2. is not divisible by tensor_model_parallel_size"),
    (dict(hidden_dropout=1.5), "hidden_dropout must be in"),
    (dict(attention_dropout=-0.1), "attention_dropout must be in"),
    (dict(ffn_hidden_size=0), "ffn_hidden_size must be a positive integer"),
    (dict(softmax_scale=0.0), "softmax_scale must be positive"),
    (dict(init_method_std=0.0), "init_method_std must be positive"),
    (dict(normalization="BatchNorm"), "normalization='BatchNorm' is not supported"),
    (dict(transformer_impl="inference_optimized"), "transformer_impl='inference_optimized' is not supported"),
    (dict(attention_backend="cudnn"), "attention_backend='cudnn' is not one of"),
    (dict(attention_backend=3), "attention_backend=3 must be an AttnBackend"),
    (dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False), "apply_query_key_layer_scaling needs attention_softmax_in_fp32"),
    (dict(multi_latent_attention=True, rotary_interleaved=True), "rotary_interleaved does not work with multi_latent_attention"),
    (dict(recompute_granularity="partial"), "recompute_granularity='partial' is not valid"),
    (dict(recompute_granularity="full"), "recompute_granularity='full' needs recompute_method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "recompute_granularity='full' needs recompute_num_layers"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=5), "needs recompute_num_layers between 1 and num_layers"),
    (dict(recompute_granularity="full", recompute_method="blocks", recompute_num_layers=1), "recompute_method='blocks' is not valid"),
    (dict(recompute_granularity="selective", recompute_method="uniform"), "recompute_method is only used with recompute_granularity='full'"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), "recompute_num_layers is only used with recompute_granularity='full'"),
    (dict(recompute_num_layers=1), "recompute_num_layers is only used with"),
    (dict(recompute_granularity="selective", recompute_modules=["attention"]), "recompute_modules has unknown entries"),
    (dict(expert_model_parallel_size=2), "expert_model_parallel_size=2 needs num_moe_experts"),
    (dict(moe_ffn_hidden_size=32), "moe_ffn_hidden_size is set but num_moe_experts is None"),
    (dict(num_moe_experts=0), "num_moe_experts must be a positive integer"),
    (dict(num_moe_experts=6, expert_model_parallel_size=4), r"num_moe_experts \(6\) is not divisible by expert_model_parallel_size \(4\)"),
    (dict(num_moe_experts=4, tensor_model_parallel_size=2, sequence_parallel=True), "need expert_tensor_parallel_size=1"),
    (dict(num_moe_experts=4, moe_router_topk=5), r"moe_router_topk \(5\) must be between 1 and num_moe_experts \(4\)"),
    (dict(num_moe_experts=4, moe_router_topk=1), "moe_router_topk=1 with softmax scores needs moe_router_pre_softmax"),
    (dict(num_moe_experts=4, moe_layer_freq=0), "moe_layer_freq must be >= 1"),
    (dict(num_moe_experts=4, moe_layer_freq=[1, 0]), "moe_layer_freq as a list needs one 0/1 entry per layer"),
    (dict(num_moe_experts=4, moe_layer_freq="1"), "moe_layer_freq must be an int or a list"),
    (dict(num_moe_experts=4, moe_router_load_balancing_type="switch"), "moe_router_load_balancing_type 'switch' is not one of"),
    (dict(num_moe_experts=4, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.1), r"has 2 value\(s\) but moe_aux_loss_coeff 1"),
    (dict(num_moe_experts=4, moe_router_score_function="relu"), "moe_router_score_function='relu'"),
    (dict(num_moe_experts=4, moe_router_dtype="bf16"), "moe_router_dtype='bf16'"),
    (dict(num_moe_experts=4, moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias needs moe_router_score_function='sigmoid'"),
    (dict(num_moe_experts=4, moe_router_group_topk=1), "moe_router_group_topk needs moe_router_num_groups"),
    (dict(num_moe_experts=4, moe_router_group_topk=1, moe_router_num_groups=3), r"num_moe_experts \(4\) is not divisible by moe_router_num_groups \(3\)"),
    (dict(num_moe_experts=4, moe_router_group_topk=3, moe_router_num_groups=2), r"moe_router_group_topk \(3\) exceeds moe_router_num_groups \(2\)"),
    (dict(num_moe_experts=4, moe_router_group_topk=1, moe_router_num_groups=2, moe_router_topk_limited_devices=1), "moe_router_topk_limited_devices is deprecated and replaced"),
    (dict(num_moe_experts=4, moe_router_padding_for_fp8=True), "moe_router_padding_for_quantization needs fp8 or fp4"),
    (dict(num_moe_experts=4, variable_seq_lengths=True), "'allgather' does not support variable_seq_lengths"),
    (dict(num_moe_experts=4, moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn", moe_router_topk=1), "moe_expert_capacity_factor does not work with sinkhorn"),
    (dict(num_moe_experts=4, moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor"),
    (dict(num_moe_experts=4, moe_token_dispatcher_type="a2a"), "moe_token_dispatcher_type='a2a' is not valid"),
    (dict(num_moe_experts=4, moe_token_drop_policy="random"), "moe_token_drop_policy='random'"),
    (dict(num_moe_experts=4, moe_shared_expert_intermediate_size=0), "moe_shared_expert_intermediate_size must be positive"),
    (dict(num_moe_experts=4, moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True), "moe_shared_expert_overlap needs moe_token_dispatcher_type='alltoall'"),
]


@pytest.mark.parametrize("overrides, message", VALUE_ERRORS)
def test_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        _build(**overrides)


def test_mla_validation():
    with pytest.raises(ValueError, match="rope_type='ntk' is not valid"):
        MLATransformerConfig(**BASE, rope_type="ntk")
    assert MLATransformerConfig(**BASE, rope_type="rope").rope_type == "rope"


def test_moe_router_conversions():
    with pytest.warns(UserWarning, match="moe_router_topk_limited_devices is deprecated"):
        c = _build(num_moe_experts=4, moe_router_topk_limited_devices=1, expert_model_parallel_size=2)
    assert (c.moe_router_group_topk, c.moe_router_num_groups) == (1, 2)
    assert dataclasses.replace(c, hidden_dropout=0.0).moe_router_group_topk == 1
    c = _build(num_moe_experts=4, moe_expert_capacity_factor=-1.0)
    assert c.moe_expert_capacity_factor is None  # negative means dropless, as in Megatron
    with pytest.warns(UserWarning, match="moe_layer_recompute is deprecated"):
        c = _build(num_moe_experts=4, moe_layer_recompute=True)
    assert (c.recompute_granularity, "moe" in c.recompute_modules) == ("selective", True)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="moe_layer_recompute cannot be combined"):
        _build(num_moe_experts=4, moe_layer_recompute=True, recompute_granularity="full",
               recompute_method="block", recompute_num_layers=1)


def _non_default(value):
    """A value different from `value` of a plausible type, to switch a field away from its default."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_other"
    return 2  # None or an object default


@pytest.mark.parametrize("name", list(tc.UNSUPPORTED))
def test_unsupported_fields_raise(name):
    value = _non_default(_default(TransformerConfig, name))
    with pytest.raises(NotImplementedError, match=rf"^{name}=.*is not supported yet; leave it at"):
        _build(**{name: value})


def test_unsupported_table_covers_the_blocked_features():
    blocked = ["fp8_param", "fp8_dot_product_attention", "fp4", "use_kitchen",
               "masked_softmax_fusion", "flash_decode",
               "heterogeneous_block_specs", "quant_recipe",
               "mrope_section", "symmetric_ar_type"]
    assert not [name for name in blocked if name not in tc.UNSUPPORTED]
    with pytest.raises(NotImplementedError, match="distribute_saved_activations=True"):
        _build(distribute_saved_activations=True)
    with pytest.raises(NotImplementedError, match="moe_token_dispatcher_type='flex'"):
        _build(num_moe_experts=4, moe_token_dispatcher_type="flex")
    with pytest.raises(NotImplementedError, match="recompute_modules contains 'moe_act'"):
        _build(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act"])


def test_supported_fields_build():
    from functools import partial

    supported = dict(
        softmax_scale=0.125, hidden_dropout=0.0, attention_dropout=0.0, fp32_residual_connection=True,
        apply_residual_connection_post_layernorm=True, layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=True, add_bias_linear=False, add_qkv_bias=True,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", qk_layernorm=True,
        init_method=partial(torch.nn.init.normal_, std=0.01), init_method_std=0.01,
        apply_query_key_layer_scaling=True, rotary_interleaved=True, calculate_per_token_loss=True,
        bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=True,
        attention_backend=AttnBackend.local, transformer_impl="local", test_mode=True,
        distribute_saved_activations=False, recompute_granularity="selective",
        recompute_modules=["core_attn", "mlp", "layernorm"], num_layers_in_first_pipeline_stage=None,
        account_for_embedding_in_pipeline_split=False, init_model_with_meta_device=False,
    )
    c = _build(**supported)
    assert c.recompute_modules == ["core_attn", "mlp", "layernorm"]
    full = _build(recompute_granularity="full", recompute_method="block", recompute_num_layers=4)
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "block", 4)
    assert _build(multi_latent_attention=True).multi_latent_attention
    moe = _build(num_moe_experts=8, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                 expert_model_parallel_size=2, add_bias_linear=False, moe_grouped_gemm=True,
                 moe_aux_loss_coeff=[1e-2, 1e-3], moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=64,
                 moe_shared_expert_overlap=True, moe_layer_freq=[1, 0, 1, 0],
                 moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_expert_capacity_factor=1.5,
                 moe_pad_expert_input_to_capacity=True, moe_router_score_function="sigmoid",
                 moe_router_enable_expert_bias=True, moe_router_dtype="fp32")
    assert moe.moe_ffn_hidden_size == 256
    # dataclasses.replace re-runs __post_init__ on already-resolved values: it must be idempotent.
    assert dataclasses.replace(c) == c and dataclasses.replace(moe) == moe

