"""Chained optimizers make the same collectives on every rank, whatever params a rank holds.

A hand-split two-stage model (PP=2, DP=4, EP=2, expert-DP=2): stage 0 holds only an embedding
and a norm weight (no expert params, no matrix Muon would take), stage 1 a dense matrix, a
norm weight, one expert (matrix + bias, `allreduce=False`, a different one per EP rank) and the
output layer. So the chain's parts (dense/expert, Muon/its scalar side) are empty on stage 0.
Every step must finish on all ranks (run under a timeout) and report the grad norm and zero
count of the full model, computed here in plain PyTorch; SGD's clipped update is checked
against torch's own clipping, Muon's against the same optimizer on the full model in one process.
"""

import math

import torch

from dist import run_distributed
from teratron import parallel_state
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.optimizer import OptimizerConfig, get_megatron_optimizer

H, FFN, VOCAB, EP, LR, CLIP, TIMEOUT = 8, 16, 12, 2, 0.1, 1.0, 120

# name -> shape, per stage; "E" in a name is the expert's index (the EP rank that holds it).
_STAGES = [
    {"embedding.word_embeddings.weight": (VOCAB, H), "decoder.layers.0.input_layernorm.weight": (H,)},
    {"decoder.layers.0.mlp.linear_fc1.weight": (FFN, H), "decoder.layers.0.pre_mlp_layernorm.weight": (H,),
     "decoder.layers.0.mlp.experts.E.weight": (H, H), "decoder.layers.0.mlp.experts.E.bias": (H,),
     "output_layer.weight": (VOCAB, H)},
]


def _full_names():
    """(stage, local name, expert index or None, full-model name)."""
    out = []
    for stage, params in enumerate(_STAGES):
        for name in params:
            experts = range(EP) if ".E." in name else [None]
            for e in experts:
                full = name if e is None else name.replace(".E.", f".{e}.")
                out.append((stage, name, e, f"{stage}.{full}"))
    return out


def _full_model():
    """Full params and grads, some grad elements zero (for the zero count)."""
    g = torch.Generator().manual_seed(0)
    params, grads = {}, {}
    for stage, name, _, full in _full_names():
        shape = _STAGES[stage][name]
        params[full] = torch.randn(shape, generator=g)
        grads[full] = torch.randn(shape, generator=g) * (1 + stage)
    grads["0.embedding.word_embeddings.weight"][:2] = 0.0
    grads["1.decoder.layers.0.mlp.experts.1.weight"][:, :3] = 0.0
    return params, grads


def _module(params, grads=None):
    """A module holding `params` under their dotted names (grads set when given)."""
    root = torch.nn.Module()
    for name, value in params.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        param = torch.nn.Parameter(value.clone())
        if ".experts." in name:
            param.allreduce = False
        if grads is not None:
            param.grad = grads[name].clone()
        module.register_parameter(leaf, param)
    return root


def _stage_module(stage, ep_rank, params):
    local = {name: params[full] for s, name, e, full in _full_names() if s == stage and e in (None, ep_rank)}
    return _module({name.replace(".E.", ".local."): value for name, value in local.items()})


def _local_grads(stage, ep_rank, grads):
    return {name.replace(".E.", ".local."): grads[full]
            for s, name, e, full in _full_names() if s == stage and e in (None, ep_rank)}


def _reference():
    """Full-model grad norm, zero count and SGD step after torch's own clipping."""
    params, grads = _full_model()
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))
    zeros = sum((g == 0).sum().item() for g in grads.values())
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    for k, t in tensors.items():
        t.grad = grads[k].clone()
    torch.nn.utils.clip_grad_norm_(list(tensors.values()), CLIP)
    return norm, zeros, {k: (t - LR * t.grad).detach() for k, t in tensors.items()}


def _muon_config():
    return OptimizerConfig(optimizer="muon", lr=LR, weight_decay=0.1, muon_momentum=0.9,
                           muon_fp32_matmul_prec="highest", clip_grad=CLIP, log_num_zeros_in_grad=True)


def _muon_reference():
    """The Muon chain on the full model in one process (no communication)."""
    params, grads = _full_model()
    model = _module(params, grads)
    opt = get_megatron_optimizer(_muon_config(), [model])
    ok, norm, zeros = opt.step()
    assert ok
    return norm, zeros, {name: p.detach().clone() for name, p in model.named_parameters()}


def _sgd_config(**kwargs):
    return OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=LR, weight_decay=0.0, clip_grad=CLIP,
                           log_num_zeros_in_grad=True, **kwargs)


class _Config:
    calculate_per_token_loss = False


def _step(config, ddp, dist_opt=False, inject_inf=False):
    """Build the optimizer for this rank's stage, load the full model's grads, step once."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    params, grads = _full_model()
    module = _stage_module(stage, ep_rank, params)
    chunk = module
    if ddp:
        chunk = DistributedDataParallel(_Config(), DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt), module)
    opt = get_megatron_optimizer(config, [chunk])
    local = _local_grads(stage, ep_rank, grads)
    for name, p in module.named_parameters():
        grad = local[name].clone()
        if inject_inf and stage == 1 and ".experts." in name:
            grad.view(-1)[0] = float("inf")
        if ddp:
            # DDP averages dense grads over dp_cp; expert grads it scales by 1/dp_cp too and sums
            # over expert-DP (each expert saw tokens from all EP ranks): so feed every replica
            # grads that reduce to the full model's.
            if ".experts." in name:
                grad *= parallel_state.get_data_parallel_world_size(with_context_parallel=True) \
                    // parallel_state.get_expert_data_parallel_world_size()
            p.main_grad.copy_(grad)
        else:
            p.grad = grad
    if ddp:
        finalize_model_grads([chunk])
    ok, norm, zeros = opt.step()
    out = {}
    for name, p in module.named_parameters():
        e = ep_rank if ".local." in name else None
        out[f"{stage}." + (name if e is None else name.replace(".local.", f".{e}."))] = p.detach().clone()
    return ok, norm, zeros, len(opt.chained_optimizers), out


def _run():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, expert_model_parallel_size=EP)
    assert parallel_state.get_expert_data_parallel_world_size() == 2
    return {
        "sgd": _step(_sgd_config(), ddp=False),
        "sgd_ddp": _step(_sgd_config(), ddp=True),
        "sgd_dist_opt": _step(_sgd_config(), ddp=True, dist_opt=True),
        "sgd_loss_scale": _step(_sgd_config(bf16=True, loss_scale=1.0), ddp=False),
        "sgd_loss_scale_inf": _step(_sgd_config(bf16=True, loss_scale=1.0), ddp=False, inject_inf=True),
        "muon": _step(_muon_config(), ddp=False),
        "muon_dist_opt": _step(_muon_config(), ddp=True, dist_opt=True),
    }


def test_chained_steps_agree_when_stages_hold_different_param_kinds():
    ref_norm, ref_zeros, ref_sgd = _reference()
    muon_norm, muon_zeros, ref_muon = _muon_reference()
    assert math.isclose(muon_norm, ref_norm, rel_tol=1e-6) and muon_zeros == ref_zeros
    for per_config in run_distributed(_run, 8, timeout=TIMEOUT):
        for key, (ok, norm, zeros, parts, params) in per_config.items():
            # Every rank chains every part (dense/expert, x Muon/scalar), empty ones included.
            assert parts == (4 if key.startswith("muon") else 2), (key, parts)
            if key == "sgd_loss_scale_inf":     # an inf on stage 1 skips the step on every rank
                assert (ok, norm, zeros) == (False, None, None), key
                continue
            assert ok, key
            assert math.isclose(norm, ref_norm, rel_tol=1e-6), (key, norm, ref_norm)
            assert zeros == ref_zeros, (key, zeros, ref_zeros)
            expected = ref_muon if key.startswith("muon") else ref_sgd
            for name, value in params.items():
                torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{key} {name}: {m}")
