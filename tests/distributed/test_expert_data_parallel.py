"""Expert params (allreduce=False) under EP=2 x expert-DP=2 on 4 ranks: reduced over the
expert-data-parallel group yet averaged over all 4 data-parallel ranks, stepped by their own
optimizer chained with the dense one (one global clip norm), with and without the distributed
optimizer. Reference: one process holding the dense layer and both experts, where data-parallel
rank r's batch goes through expert r % 2, plain AdamW and clip_grad_norm_."""

import itertools

import torch
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer

WORLD, EP, STEPS, LR, CLIP = 4, 2, 3, 1e-2, 0.2


class _Config:
    calculate_per_token_loss = False


def _dense():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


def _expert(e):
    torch.manual_seed(100 + e)
    return torch.nn.Linear(8, 4)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, WORLD, 3, 8, generator=g), torch.randn(STEPS, WORLD, 3, 4, generator=g)


def _loss(dense, expert, x, y):
    return F.mse_loss(expert(torch.tanh(dense(x))), y)


def _reference():
    dense, experts = _dense(), [_expert(e) for e in range(EP)]
    params = list(dense.parameters()) + [p for e in experts for p in e.parameters()]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() == 2], "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}], lr=LR)
    x, y = _data()
    for step in range(STEPS):
        opt.zero_grad()
        torch.stack([_loss(dense, experts[r % EP], x[step, r], y[step, r]) for r in range(WORLD)]).mean().backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return [p.detach().clone() for p in dense.parameters()], [[p.detach().clone() for p in e.parameters()]
                                                               for e in experts]


def _train(dist_opt, average_in_collective):
    rank = torch.distributed.get_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    expert = _expert(ep_rank)
    for p in expert.parameters():
        p.allreduce = False
    model = torch.nn.ModuleDict(dict(dense=_dense(), expert=expert))
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, average_in_collective=average_in_collective,
        overlap_grad_reduce=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, clip_grad=CLIP), [ddp])
    assert isinstance(opt, ChainedOptimizer) and len(opt.chained_optimizers) == 2
    x, y = _data()
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        _loss(model["dense"], model["expert"], x[step, rank], y[step, rank]).backward()
        finalize_model_grads([ddp])
        assert opt.step()[0]
    return ep_rank, [p.detach().clone() for p in model["dense"].parameters()], \
        [p.detach().clone() for p in model["expert"].parameters()]


def _run():
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    assert parallel_state.get_expert_data_parallel_world_size() == WORLD // EP
    return [_train(*key) for key in itertools.product((False, True), (False, True))]


def test_expert_params_reduce_over_expert_dp_and_chain_with_dense():
    ref_dense, ref_experts = _reference()
    for per_config in run_distributed(_run, WORLD):
        for ep_rank, dense, expert in per_config:
            for p, r in zip(dense + expert, ref_dense + ref_experts[ep_rank]):
                torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
