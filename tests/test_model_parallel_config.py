"""ModelParallelConfig: Megatron's defaults, derived values, validation, not-yet-supported fields."""

import dataclasses

import pytest
import torch

from teratron import model_parallel_config as mpc
from teratron.model_parallel_config import ModelParallelConfig


def _default(name):
    field = {f.name: f for f in dataclasses.fields(ModelParallelConfig)}[name]
    return field.default


def test_megatron_defaults():
    # Megatron Core's ModelParallelConfig defaults (megatron/core/model_parallel_config.py).
    expected = dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_comm_backend=None, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, sequence_parallel=False, context_parallel_size=1,
        hierarchical_context_parallel_sizes=None, max_seqlen_per_dp_cp_rank=None, hybrid_context_parallel=False,
        expert_model_parallel_size=1, expert_tensor_parallel_size=None, perform_initialization=True,
        use_cpu_initialization=False, fp16=False, bf16=False, params_dtype=torch.float32, timers=None,
        finalize_model_grads_func=None, grad_scale_func=None, mtp_grad_scale_func=None, no_sync_func=None,
        grad_sync_func=None, param_sync_func=None, deterministic_mode=False, enable_autocast=False,
        autocast_dtype=None, num_microbatches_with_partial_activation_checkpoints=None,
        gradient_accumulation_fusion=False, use_te_rng_tracker=False, tp_comm_overlap=False,
        tp_comm_bulk_wgrad=True, tp_comm_bulk_dgrad=True, tp_comm_overlap_ag=True, tp_comm_overlap_rs=True,
        tp_comm_overlap_rs_dgrad=False, tp_comm_split_ag=True, tp_comm_atomic_ag=False, tp_comm_split_rs=True,
        tp_comm_atomic_rs=False, cross_entropy_loss_fusion=False, cross_entropy_fusion_impl="native",
        tp_comm_overlap_disable_qkv=False, tp_comm_overlap_disable_fc1=False,
        tp_comm_bootstrap_backend="nccl", overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False,
        overlap_dispatch_backward_with_experts_wgrad=False, ep_overlap_early_attn_memory_release=False,
        pipeline_dtype=None, variable_seq_lengths=False, overlap_p2p_comm=False, batch_p2p_comm=True,
        batch_p2p_sync=True, use_ring_exchange_p2p=False, deallocate_pipeline_outputs=False,
        defer_embedding_wgrad_compute=False, wgrad_deferral_limit=0, overlap_p2p_comm_warmup_flush=False,
        microbatch_group_size_per_vp_stage=None, mtp_standalone=False, cpu_offloading=False,
        cpu_offloading_num_layers=0, cpu_offloading_activations=True, cpu_offloading_weights=False,
        cpu_offloading_double_buffering=False, cpu_offloading_retain_pinned_cpu_buffers=False,
        barrier_with_L1_time=True, moe_extended_tp=False, async_tensor_model_parallel_allreduce=False,
        pipeline_model_parallel_split_rank=None,
    )
    fields = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    assert fields - expected.keys() == set(), "fields without an expected default: add them to the table"
    assert expected.keys() - fields == set(), "table names fields the class does not have"
    wrong = {k: (v, _default(k)) for k, v in expected.items() if _default(k) != v or type(_default(k)) is not type(v)}
    assert not wrong


def test_derived_values():
    c = ModelParallelConfig()
    assert c.expert_tensor_parallel_size == 1
    assert c.pipeline_dtype == torch.float32 and c.autocast_dtype == torch.float32
    assert c.microbatch_group_size_per_vp_stage == 1

    c = ModelParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                            virtual_pipeline_model_parallel_size=2, params_dtype=torch.bfloat16, bf16=True)
    assert c.expert_tensor_parallel_size == 4
    assert c.pipeline_dtype == torch.bfloat16 and c.autocast_dtype == torch.bfloat16
    assert c.microbatch_group_size_per_vp_stage == 2

    c = ModelParallelConfig(tensor_model_parallel_size=4, expert_tensor_parallel_size=1,
                            pipeline_dtype=torch.float16, autocast_dtype=torch.bfloat16)
    assert c.expert_tensor_parallel_size == 1
    assert (c.pipeline_dtype, c.autocast_dtype) == (torch.float16, torch.bfloat16)


def test_sequence_parallel_without_tp_is_turned_off():
    with pytest.warns(UserWarning, match="sequence_parallel needs tensor_model_parallel_size > 1"):
        c = ModelParallelConfig(sequence_parallel=True)
    assert c.sequence_parallel is False
    assert ModelParallelConfig(sequence_parallel=True, tensor_model_parallel_size=2).sequence_parallel


def test_ep_with_tp_warns_without_sp():
    with pytest.warns(UserWarning, match="should use sequence_parallel=True"):
        ModelParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2)


@pytest.mark.parametrize("overrides, message", [
    (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size must be a positive integer"),
    (dict(pipeline_model_parallel_size=1.5), "pipeline_model_parallel_size must be a positive integer"),
    (dict(expert_model_parallel_size=True), "expert_model_parallel_size must be a positive integer"),
    (dict(expert_tensor_parallel_size=0), "expert_tensor_parallel_size must be a positive integer"),
    (dict(virtual_pipeline_model_parallel_size=2), "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"),
    (dict(virtual_pipeline_model_parallel_size=0, pipeline_model_parallel_size=2), "virtual_pipeline_model_parallel_size must be a positive integer"),
    (dict(fp16=True, bf16=True), "fp16 and bf16 are both True"),
    (dict(params_dtype=torch.int32), "params_dtype must be a floating torch.dtype"),
    (dict(params_dtype="bf16"), "params_dtype must be a floating torch.dtype"),
    (dict(overlap_p2p_comm=True), "overlap_p2p_comm needs batch_p2p_comm=False"),
    (dict(microbatch_group_size_per_vp_stage=0), "microbatch_group_size_per_vp_stage must be a positive integer"),
])
def test_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelParallelConfig(**overrides)


def _non_default(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "_other"
    return 2


@pytest.mark.parametrize("name", list(mpc.UNSUPPORTED))
def test_unsupported_fields_raise(name):
    value = _non_default(_default(name))
    with pytest.raises(NotImplementedError, match=rf"^{name}=.*is not supported yet; leave it at"):
        ModelParallelConfig(**{name: value})


def test_unsupported_message():
    with pytest.raises(NotImplementedError) as info:
        ModelParallelConfig(hybrid_context_parallel=True)
    assert str(info.value) == ("hybrid_context_parallel=True: hybrid context parallelism is not supported yet; "
                               "leave it at False")
    assert "tp_comm_overlap" in mpc.UNSUPPORTED and "gradient_accumulation_fusion" not in mpc.UNSUPPORTED


def test_context_parallel_sizes():
    config = ModelParallelConfig(context_parallel_size=4, hierarchical_context_parallel_sizes=(2, 2))
    assert config.hierarchical_context_parallel_sizes == [2, 2]
    with pytest.raises(ValueError, match=r"^hierarchical_context_parallel_sizes=\[2, 3\] multiply to 6, not "
                                         r"context_parallel_size=4; make their product the CP size$"):
        ModelParallelConfig(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3])
    with pytest.raises(ValueError, match="context_parallel_size must be a positive integer"):
        ModelParallelConfig(context_parallel_size=0)


def test_supported_fields_build():
    def hook(*args):
        return None

    c = ModelParallelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
        sequence_parallel=True, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
        perform_initialization=False, use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
        timers=hook, finalize_model_grads_func=hook, grad_scale_func=hook, no_sync_func=hook,
        grad_sync_func=hook, param_sync_func=hook, deterministic_mode=True, enable_autocast=True,
        variable_seq_lengths=True, overlap_p2p_comm=True, batch_p2p_comm=False, batch_p2p_sync=False,
        deallocate_pipeline_outputs=True, microbatch_group_size_per_vp_stage=3, barrier_with_L1_time=False,
    )
    assert c.microbatch_group_size_per_vp_stage == 3
