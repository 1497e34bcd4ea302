"""End to end: a 2-layer GPT whose first layer is MoE (moe_layer_freq [1, 0]), wrapped in DDP,
under EP = 2 (x DP = 2) gives the single-process loss and gradients (DDP averages dense grads
over data parallel and expert grads over expert-data parallel)."""

import torch
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.process_groups import ProcessGroupCollection
from teratron.transformer.moe import MoEAuxLossAutoScaler, get_moe_module_spec
from teratron.transformer.transformer_block import TransformerBlockSubmodules
from teratron.transformer.transformer_config import TransformerConfig

WORLD, VOCAB, SEQ, BATCH = 2, 64, 8, 2


def build(ep, dispatcher, pg_collection=None):
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4,
        moe_ffn_hidden_size=16, moe_router_topk=2, moe_layer_freq=[1, 0], moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=1e-3, moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, init_method_std=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
        use_cpu_initialization=True)
    moe, dense = get_gpt_layer_local_spec(), get_gpt_layer_local_spec()
    moe.submodules.mlp = get_moe_module_spec(num_experts=4)
    torch.manual_seed(99)
    return GPTModel(config, TransformerBlockSubmodules(layer_specs=[moe, dense]), VOCAB, SEQ,
                    position_embedding_type="rope", pg_collection=pg_collection)


def batch(d):
    g = torch.Generator().manual_seed(d)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.arange(SEQ).expand(BATCH, SEQ), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def reference_piece(name, full, model):
    """This rank's piece of the single-process tensor: its experts (numbered locally)."""
    if ".experts.local_experts." in name:
        prefix, rest = name.split(".experts.local_experts.")
        local, tail = rest.split(".", 1)
        indices = model.get_submodule(prefix).local_expert_indices
        return full[f"{prefix}.experts.local_experts.{indices[int(local)]}.{tail}"]
    return full[name]


def check(dispatcher):
    # The reference backwards the mean over the data-parallel ranks' losses; aux losses join it
    # with the same 1 / WORLD factor.
    MoEAuxLossAutoScaler.set_loss_scale(1.0 / WORLD)
    ref = build(1, dispatcher, ProcessGroupCollection())
    ref_losses = []
    for d in range(WORLD):
        ids, positions, labels = batch(d)
        loss = ref(ids, positions, labels=labels).mean()
        (loss / WORLD).backward()
        ref_losses.append(loss.detach())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    parallel_state.initialize_model_parallel(1, expert_model_parallel_size=WORLD)
    try:
        MoEAuxLossAutoScaler.set_loss_scale(1.0)
        model = build(WORLD, dispatcher)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        ids, positions, labels = batch(parallel_state.get_data_parallel_rank())
        loss = ddp(ids, positions, labels=labels).mean()
        loss.backward()
        finalize_model_grads([ddp])
        torch.testing.assert_close(loss, ref_losses[parallel_state.get_data_parallel_rank()])
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, reference_piece(name, ref_params, model),
                                       msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(param.main_grad, reference_piece(name, ref_grads, model),
                                       msg=lambda m: f"grad {name}: {m}")
    finally:
        parallel_state.destroy_model_parallel()
    return True


def both_dispatchers():
    return check("alltoall") and check("allgather")


def test_gpt_with_moe_under_ep2_equals_single_process():
    assert all(run_distributed(both_dispatchers, WORLD))
