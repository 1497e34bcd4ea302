"""FullyShardedDataParallel's memory: with optim_grads_params each rank holds 1/DP of the params,
grads and optimizer states (fp32 shards; bf16 only while a layer runs), and `teratron estimate`
models those bytes."""

import torch

from dist import run_distributed
from teratron.estimate.report import estimate_from_args
from teratron.training.arguments import parse_train_args
from teratron.training.build import build_model, build_optimizer
from teratron.training.config import run_config_from_args

FLAGS = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 250 --num-layers 2 --hidden-size 64 "
         "--num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --train-iters 1 --lr 1e-3 --bf16 "
         "--accumulate-allreduce-grads-in-fp32 --use-torch-fsdp2").split()


def _state_bytes(world_size: int):
    """(params + grads + optimizer states bytes this rank holds after a step, the estimate's)."""
    from teratron import parallel_state
    from teratron.training.initialize import initialize_model_parallel

    args = parse_train_args(FLAGS)
    estimate = estimate_from_args(args, world_size, "cpu").stages[0].memory.states
    run = run_config_from_args(args, world_size, 250, cuda=False)
    initialize_model_parallel(run.transformer, run.distributed)
    try:
        model = build_model(run, torch.device("cpu"))
        optimizer = build_optimizer(run, model)
        for chunk in model:
            chunk.finish_grad_sync()  # zero grads: every param gets its main_grad shard
        optimizer.step()
        with torch.no_grad():
            params = [p for chunk in model for p in chunk.parameters()]
            weights = sum(p.to_local().nbytes for p in params)
            dtypes = {p.to_local().dtype for p in params}
        grads = sum(p.main_grad.nbytes for p in params)
        states = sum(t.nbytes for s in optimizer.optimizer.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.dim() > 0)
    finally:
        parallel_state.destroy_model_parallel()
    return weights + grads + states, estimate.total, dtypes


def _parameter_count():
    run = run_config_from_args(parse_train_args(FLAGS[:-1]), 1, 250, cuda=False)  # no FSDP: whole params
    return sum(p.numel() for chunk in build_model(run, torch.device("cpu")) for p in chunk.parameters())


def test_each_rank_holds_a_data_parallel_share_of_the_states_and_the_estimate_agrees():
    unsharded = 16 * _parameter_count()  # fp32 param, fp32 grad, Adam's two fp32 states
    for real, estimated, dtypes in run_distributed(_state_bytes, 2, 2):
        assert dtypes == {torch.float32}  # the shards are the fp32 master weights
        assert real == unsharded // 2  # every sharded dim is even here: no padding
        assert abs(estimated - real) <= 0.05 * real
