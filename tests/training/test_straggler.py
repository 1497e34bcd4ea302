"""--log-straggler (teratron.training.straggler): at DP = 2, a rank whose forward is slowed is
named the slowest every log interval, though the gradient reduction makes both ranks' whole
steps equally long; --straggler-minmax-count names more ranks."""

import contextlib
import io
import re
import time

import torch

from dist import run_distributed
from teratron.training import trainer as trainer_module
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.straggler import StragglerReport
from teratron.training.training import pretrain

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "1",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "2", "--eval-iters", "0",
        "--num-workers", "0", "--no-progress-bar", "--train-iters", "4", "--log-straggler"]
DELAY_S = 0.2


def _train_with_a_slow_rank(slow_rank):
    import torch.distributed as dist

    if dist.get_rank() == slow_rank:
        forward_step = trainer_module.forward_step

        def slow_forward_step(*args, **kwargs):
            time.sleep(DELAY_S)
            return forward_step(*args, **kwargs)

        trainer_module.forward_step = slow_forward_step
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(build_run_config(parse_train_args(TINY), 2))
    return out.getvalue()


def test_the_slowed_rank_is_named_every_log_interval():
    logged = run_distributed(_train_with_a_slow_rank, 2, 0)[1]  # rank 1 logs; rank 0 is slowed
    lines = [line for line in logged.splitlines() if line.startswith("straggler: ")]
    assert len(lines) == 2, logged  # iterations 2 and 4
    for line in lines:
        slowest = re.search(r"slowest rank\(s\) (\d+) \(([\d.]+) ms\)", line)
        fastest = re.search(r"fastest rank\(s\) (\d+) \(([\d.]+) ms\)", line)
        assert (slowest.group(1), fastest.group(1)) == ("0", "1"), line
        assert float(slowest.group(2)) - float(fastest.group(2)) >= DELAY_S * 1000 * 0.9, line


class _Config:
    finalize_model_grads_func = staticmethod(lambda *args: None)


def test_the_line_names_minmax_count_ranks_each_way():
    report = StragglerReport(_Config(), torch.device("cpu"), minmax_count=2)
    line = report.line([0.010, 0.040, 0.020, 0.030])
    assert line == ("straggler: step time up to the gradient reduction, slowest rank(s) 1 (40.0 ms), 3 (30.0 ms) | "
                    "fastest rank(s) 0 (10.0 ms), 2 (20.0 ms) | slowest / fastest 4.00")


def test_the_time_runs_to_the_gradient_reduction():
    config = _Config()
    report = StragglerReport(config, torch.device("cpu"))
    for _ in range(2):
        report.step_started()
        time.sleep(0.05)
        config.finalize_model_grads_func()
        time.sleep(0.2)  # the reduction and the optimizer: not counted
        report.step_ended()
    report.step_started()
    report.step_ended()  # a step that never reached the reduction: not counted
    (mean,) = report.gather()
    assert 0.05 <= mean < 0.15
    assert report.gather() == [0.0]  # each gather starts a new window
