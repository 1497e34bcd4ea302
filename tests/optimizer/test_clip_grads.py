"""Grad reduction, global grad norm, clipping, zero count and params norm under TP2 x PP2 x DP2
equal the single-process numbers of the same full model.

The full model (two "stages", each a column- and a row-parallel weight, a replicated bias, a
sequence-parallel norm weight, plus an embedding tied to the last stage's output weight) and
its full grads are drawn from a seed. Each rank holds its TP shard of its stage; the
sequence-parallel norm grad is split into per-TP-rank partial sums and the tied embedding grad
into one contribution per stage, so finalize_model_grads has to add them back.
"""

import math

import torch

from dist import run_distributed
from teratron import parallel_state
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.optimizer import OptimizerConfig, calc_params_l2_norm, get_megatron_optimizer
from teratron.tensor_parallel.utils import shard_tensor

H, FFN, VOCAB, LR, CLIP = 8, 16, 12, 0.1, 1.0
# name -> (shape, TP partition dim or None for replicated)
_STAGE_PARAMS = {"fc1": ((FFN, H), 0), "fc2": ((H, FFN), 1), "fc2_bias": ((H,), None), "norm": ((H,), None)}


class _Config:
    calculate_per_token_loss = False


def _full_model():
    """Full params and full grads of both stages; zeros in some grads for the zero count."""
    g = torch.Generator().manual_seed(0)
    params, grads = {}, {}
    for stage in range(2):
        for name, (shape, _) in _STAGE_PARAMS.items():
            params[f"{stage}.{name}"] = torch.randn(shape, generator=g)
            grads[f"{stage}.{name}"] = torch.randn(shape, generator=g) * (stage + 1)
    grads["0.fc1"][:3] = 0.0
    params["embedding"] = torch.randn(VOCAB, H, generator=g)
    grads["embedding.from_stage0"] = torch.randn(VOCAB, H, generator=g)
    grads["embedding.from_stage1"] = torch.randn(VOCAB, H, generator=g)
    return params, grads


def _reference():
    params, grads = _full_model()
    full_grads = {k: v for k, v in grads.items() if not k.startswith("embedding")}
    full_grads["embedding"] = grads["embedding.from_stage0"] + grads["embedding.from_stage1"]
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in full_grads.values()))
    zeros = sum((g == 0).sum().item() for g in full_grads.values())
    params_norm = math.sqrt(sum(p.double().pow(2).sum().item() for p in params.values()))
    # Plain PyTorch clipping + SGD step on the full model.
    tensors = {k: params[k].clone().requires_grad_() for k in full_grads}
    for k, t in tensors.items():
        t.grad = full_grads[k].clone()
    torch.nn.utils.clip_grad_norm_(list(tensors.values()), CLIP)
    updated = {k: (t - LR * t.grad).detach() for k, t in tensors.items()}
    return norm, zeros, params_norm, updated


class _Stage(torch.nn.Module):
    def __init__(self, stage, params, tp_rank, tp_size):
        super().__init__()
        for name, (_, dim) in _STAGE_PARAMS.items():
            full = params[f"{stage}.{name}"]
            p = torch.nn.Parameter(full.clone() if dim is None else shard_tensor(full, dim, 1, tp_rank, tp_size))
            p.tensor_model_parallel = dim is not None
            if dim is not None:
                p.partition_dim, p.partition_stride = dim, 1
            self.register_parameter(name, p)
        self.norm.sequence_parallel = True
        emb = torch.nn.Parameter(shard_tensor(params["embedding"], 0, 1, tp_rank, tp_size))
        emb.tensor_model_parallel, emb.partition_dim, emb.partition_stride = True, 0, 1
        emb.shared_embedding = True
        if stage == 1:
            emb.shared = True     # the output layer's copy of the tied embedding
        self.register_parameter("embedding", emb)
        self.share_embeddings_and_output_weights = True  # GPTModel's interface for finalize_model_grads

    def shared_embedding_or_output_weight(self):
        return self.embedding


def _local_grad(stage, name, grads, tp_rank, tp_size):
    if name == "embedding":
        return shard_tensor(grads[f"embedding.from_stage{stage}"], 0, 1, tp_rank, tp_size)
    full = grads[f"{stage}.{name}"]
    dim = _STAGE_PARAMS[name][1]
    if name == "norm":   # sequence parallel: each TP rank saw half the tokens
        return full * (0.25 if tp_rank == 0 else 0.75)
    return full.clone() if dim is None else shard_tensor(full, dim, 1, tp_rank, tp_size)


def _check(wrap_in_ddp, dist_opt=False):
    """wrap_in_ddp=False: a plain module whose .grad finalize_model_grads reduces directly."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    params, grads = _full_model()
    module = _Stage(stage, params, tp_rank, 2)
    ddp = module
    if wrap_in_ddp:
        ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(use_distributed_optimizer=dist_opt),
                                      module)
    params_norm = calc_params_l2_norm([ddp])
    for name, p in module.named_parameters():
        grad = _local_grad(stage, name, grads, tp_rank, 2)
        if wrap_in_ddp:
            p.main_grad.copy_(grad)
        else:
            p.grad = grad
    finalize_model_grads([ddp])
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=LR, weight_decay=0.0,
                                                 clip_grad=CLIP, log_num_zeros_in_grad=True), [ddp])
    ok, grad_norm, zeros = opt.step()
    assert ok
    full_params = {}
    for name, (_, dim) in _STAGE_PARAMS.items():
        full_params[f"{stage}.{name}"] = (getattr(module, name).detach().clone(), dim)
    full_params["embedding"] = (module.embedding.detach().clone(), 0)
    return dict(stage=stage, tp_rank=tp_rank, grad_norm=grad_norm, zeros=zeros, params_norm=params_norm,
                params=full_params)


def _run():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    return [_check(False), _check(True), _check(True, dist_opt=True)]


def test_grad_norm_clip_and_zero_count_tp2_pp2_dp2():
    ref_norm, ref_zeros, ref_params_norm, ref_updated = _reference()
    results = run_distributed(_run, 8)
    for per_config in results:
        for r in per_config:
            assert math.isclose(r["grad_norm"], ref_norm, rel_tol=1e-6), (r["grad_norm"], ref_norm)
            assert r["zeros"] == ref_zeros, (r["zeros"], ref_zeros)
            assert math.isclose(r["params_norm"], ref_params_norm, rel_tol=1e-6)
            for key, (local, dim) in r["params"].items():
                ref = ref_updated[key]
                expected = ref if dim is None else shard_tensor(ref, dim, 1, r["tp_rank"], 2)
                torch.testing.assert_close(local, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")
