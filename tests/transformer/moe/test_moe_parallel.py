"""MoELayer under expert (EP = 2, 4), tensor (+ sequence) and expert-tensor parallelism, with
both token dispatchers and shared experts (gated or not), equals the EP = 1 single-process
layer: outputs, input grads, every parameter and every gradient (reduced over its
data-parallel group as DDP would), the logged metrics and the quantile-balancing bias. Weights
come from the same seed (layout-invariant init), never copied. One launch of 4 ranks runs every
layout.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel import shard_tensor
from teratron.transformer.init_rng import component_rng
from teratron.transformer.moe import (MoEAuxLossAutoScaler, get_moe_module_spec, track_moe_metrics,
                                      update_moe_routers)
from teratron.transformer.moe.moe_logging import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from teratron.transformer.moe.router import TopKRouter
from teratron.transformer.spec_utils import build_module
from teratron.transformer.transformer_config import TransformerConfig

WORLD, S, B, H, E = 4, 8, 2, 16, 8


@dataclasses.dataclass(frozen=True)
class Case:
    tp: int
    ep: int
    etp: int
    sp: bool
    dispatcher: str
    grouped: bool = False
    swiglu: bool = False
    bias: bool = False
    shared: bool = False
    gated: bool = False  # the shared experts' sigmoid gate
    capacity: float = None
    qb: bool = False


CASES = [
    Case(1, 4, 1, False, "alltoall", swiglu=True, bias=True),
    Case(1, 4, 1, False, "allgather", grouped=True, bias=True),
    Case(1, 4, 1, False, "alltoall", grouped=True, capacity=1.0),  # drops tokens
    Case(1, 2, 1, False, "alltoall", shared=True),                  # EP 2 x DP 2
    Case(1, 2, 2, False, "alltoall", swiglu=True),                  # expert-TP without dense TP
    Case(1, 2, 2, False, "allgather", grouped=True, swiglu=True),
    Case(2, 2, 2, True, "alltoall", shared=True, qb=True),
    Case(2, 2, 2, True, "allgather", grouped=True, swiglu=True),
    Case(2, 2, 1, True, "alltoall", grouped=True, bias=True),
    Case(2, 2, 1, False, "alltoall", shared=True),                  # TP without SP: tokens split
    Case(2, 2, 2, True, "allgather", shared=True, gated=True),      # gated shared experts under TP + SP
    Case(2, 2, 1, False, "alltoall", swiglu=True, shared=True, gated=True),  # ... and TP without SP
    Case(2, 2, 2, False, "allgather", swiglu=True),
    Case(2, 1, 2, True, "alltoall", grouped=True),                  # EP 1 under TP
    Case(1, 1, 2, False, "allgather", swiglu=True),                 # EP 1, expert-TP only
]


def make_config(case, parallel, device="cpu"):
    sizes = dict(tensor_model_parallel_size=case.tp, sequence_parallel=case.sp,
                 expert_model_parallel_size=case.ep, expert_tensor_parallel_size=case.etp) if parallel else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_ffn_hidden_size=8,
        moe_router_topk=2, init_method_std=0.3, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=case.bias, gated_linear_unit=case.swiglu,
        activation_func=F.silu if case.swiglu else None, moe_token_dispatcher_type=case.dispatcher,
        moe_router_load_balancing_type="quantile_balancing" if case.qb else "aux_loss",
        moe_aux_loss_coeff=0.0 if case.qb else 0.01, moe_z_loss_coeff=1e-3,
        moe_expert_capacity_factor=case.capacity,
        moe_shared_expert_intermediate_size=8 if case.shared else None, moe_shared_expert_gate=case.gated,
        moe_per_layer_logging=True,
        use_cpu_initialization=device == "cpu", **sizes)
    return config


def build(config, grouped):
    torch.manual_seed(1234)
    with component_rng("layer1"):
        return build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=grouped),
                            config=config, layer_number=1)


def shard_data(d, device="cpu"):
    g = torch.Generator().manual_seed(100 + d)
    return torch.randn(S, B, H, generator=g).to(device), torch.randn(S, B, H, generator=g).to(device)


def reference_name(name, layer):
    """The EP = 1 parameter a local one is a piece of (SequentialMLP numbers experts locally)."""
    parts = name.split(".")
    if parts[:2] == ["experts", "local_experts"]:
        parts[2] = str(layer.local_expert_indices[int(parts[2])])
    return ".".join(parts)


def expected_piece(name, param, full, layer):
    """This rank's piece of the EP = 1 tensor `full`: its experts, its (expert-)TP shard."""
    if name.startswith("experts.") and not name.startswith("experts.local_experts"):
        full = full[layer.local_expert_indices]  # GroupedMLP stacks the local experts
    if not getattr(param, "tensor_model_parallel", False):
        return full
    pg = layer.pg_collection
    group = pg.expt_tp if name.startswith("experts.") else pg.tp
    return shard_tensor(full, param.partition_dim, param.partition_stride, get_pg_rank(group), get_pg_size(group))


def run_reference(case, device):
    """The EP = 1 layer on every data-parallel shard (parallel_state is not initialised)."""
    clear_aux_losses_tracker()
    layer = build(make_config(case, parallel=False, device=device), case.grouped)
    outputs = []
    for d in range(dist.get_world_size() // case.tp):
        x, grad = shard_data(d, device)
        x.requires_grad_()
        y = layer(x)[0]
        y.backward(grad)
        outputs.append((y.detach(), x.grad))
    tracker = {k: v.clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
    clear_aux_losses_tracker()
    update_moe_routers(layer)
    return layer, outputs, tracker


def check_case(case, device="cpu"):
    """One layout against EP = 1 (on `device`: the NCCL check runs it on GPUs)."""
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    ref, ref_outputs, ref_tracker = run_reference(case, device)
    parallel_state.initialize_model_parallel(case.tp, expert_model_parallel_size=case.ep,
                                             expert_tensor_parallel_size=case.etp)
    try:
        config = make_config(case, parallel=True, device=device)
        layer = build(config, case.grouped)
        dp = parallel_state.get_data_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        x, grad = shard_data(parallel_state.get_data_parallel_rank(), device)
        y_ref, dx_ref = ref_outputs[parallel_state.get_data_parallel_rank()]
        if case.sp:  # this rank's slice of the sequence
            x, grad, y_ref, dx_ref = (t.chunk(case.tp)[tp_rank] for t in (x, grad, y_ref, dx_ref))
        x = x.clone().requires_grad_()
        y = layer(x)[0]
        y.backward(grad)
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(x.grad, dx_ref)

        ref_params = dict(ref.named_parameters())
        for name, param in layer.named_parameters():
            full = ref_params[reference_name(name, layer)]
            torch.testing.assert_close(param, expected_piece(name, param, full, layer),
                                       msg=lambda m: f"{name}: {m}")
            g = param.grad.clone()
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
            expert = not getattr(param, "allreduce", True)
            dist.all_reduce(g, group=parallel_state.get_expert_data_parallel_group() if expert
                            else parallel_state.get_data_parallel_group())
            torch.testing.assert_close(g, expected_piece(name, param, full.grad, layer),
                                       msg=lambda m: f"grad {name}: {m}")

        metrics = track_moe_metrics(1.0, config)
        if not case.qb:
            expected = ref_tracker["load_balancing_loss"][0].item() / dp
            torch.testing.assert_close(metrics["load_balancing_loss"], expected)
        torch.testing.assert_close(metrics["z_loss"], ref_tracker["z_loss"][0].item() / dp)
        assert metrics["tokens_per_expert_layer_1"] == ref_tracker["tokens_per_expert"][0].tolist()
        if case.qb:
            update_moe_routers(layer)
            torch.testing.assert_close(layer.router.qb_beta, ref.router.qb_beta)
    finally:
        parallel_state.destroy_model_parallel()


def check_router_statistics():
    """Over DP = 4: the global aux loss and the expert-bias update see all ranks' tokens, so they
    equal the plain aux loss and the update of one router fed every rank's tokens at once."""
    def config(kind):
        return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                 moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1,
                                 init_method_std=0.3, use_cpu_initialization=True)

    def router(kind):
        torch.manual_seed(5)
        r = TopKRouter(config(kind))
        r.set_layer_number(1)
        return r

    tokens = [shard_data(d)[0] for d in range(WORLD)]
    ref = router("aux_loss")
    (ref(torch.cat(tokens, dim=1))[0].sum() * 0).backward()  # batch dim: every rank's sequences
    update_moe_routers(ref)
    clear_aux_losses_tracker()
    parallel_state.initialize_model_parallel(1)
    try:
        r = router("global_aux_loss")
        (r(tokens[dist.get_rank()])[0].sum() * 0).backward()
        dist.all_reduce(r.weight.grad)
        torch.testing.assert_close(r.weight.grad, ref.weight.grad)
        update_moe_routers(r)
        torch.testing.assert_close(r.expert_bias, ref.expert_bias)
        assert r.expert_bias.abs().sum() > 0
    finally:
        parallel_state.destroy_model_parallel()
        clear_aux_losses_tracker()


def all_layouts():
    for case in CASES:
        try:
            check_case(case)
        except Exception as error:
            raise AssertionError(f"{case}: {error}") from error
    check_router_statistics()
    return True


def test_moe_layouts_equal_single_process():
    assert all(run_distributed(all_layouts, WORLD))
