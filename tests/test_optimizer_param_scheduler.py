"""OptimizerParamScheduler at hand-computed steps (the arithmetic is in the comments)."""

import math

import pytest
import torch

from teratron.optimizer_param_scheduler import OptimizerParamScheduler


def _optimizer():
    p = torch.nn.Parameter(torch.zeros(1))
    return torch.optim.SGD([{"params": [p]},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr_mult": 2.0, "wd_mult": 0.0,
                             "max_lr": 0.5, "min_lr": 0.05}], lr=0.0)


def _scheduler(style, **kwargs):
    args = dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=10, lr_decay_steps=110,
                lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=100, wd_incr_style="constant")
    args.update(kwargs)
    return OptimizerParamScheduler(_optimizer(), **args)


def _lr_at(scheduler, step, group=0):
    scheduler.step(step - scheduler.num_steps)
    return scheduler.optimizer.param_groups[group]["lr"]


@pytest.mark.parametrize("style, step, expected", [
    ("linear", 5, 0.5),                 # warm-up: 0 + (1 - 0) * 5/10
    ("linear", 10, 1.0),
    ("linear", 60, 0.55),               # ratio (60-10)/100 = 0.5: 0.1 + 0.5 * 0.9
    ("linear", 110, 0.1),
    ("linear", 500, 0.1),               # past the decay: min_lr
    ("cosine", 60, 0.55),               # 0.1 + 0.5 * (cos(pi/2) + 1) * 0.9
    ("cosine", 35, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),   # ratio 0.25
    ("constant", 5, 0.5),
    ("constant", 500, 1.0),
])
def test_lr_decay_styles(style, step, expected):
    assert _lr_at(_scheduler(style), step) == pytest.approx(expected)


def test_inverse_square_root():
    s = _scheduler("inverse-square-root", lr_warmup_steps=4, lr_decay_steps=10 ** 6, min_lr=0.0)
    assert _lr_at(s, 2) == pytest.approx(0.5)      # warm-up
    assert _lr_at(s, 16) == pytest.approx(0.5)     # 1 * sqrt(4) / sqrt(16)
    assert _lr_at(s, 100) == pytest.approx(0.2)    # 1 * 2 / 10
    s = _scheduler("inverse-square-root", lr_warmup_steps=4, lr_decay_steps=10 ** 6, min_lr=0.1)
    assert _lr_at(s, 10000) == pytest.approx(0.1)  # 2 / 100 = 0.02 clamped to min_lr


@pytest.mark.parametrize("wsd_style, step, expected", [
    ("linear", 50, 1.0),                # stable phase (anneal starts at 110 - 20 = 90)
    ("linear", 90, 1.0),
    ("linear", 100, 0.55),              # ratio 10/20: 0.1 + 0.5 * 0.9
    ("cosine", 100, 0.55),
    ("exponential", 100, 0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1)),
    ("minus_sqrt", 95, 0.55),           # ratio 0.25: 1 - sqrt(0.25) = 0.5
    ("linear", 110, 0.1),
])
def test_wsd(wsd_style, step, expected):
    s = _scheduler("WSD", wsd_decay_steps=20, lr_wsd_decay_style=wsd_style)
    assert _lr_at(s, step) == pytest.approx(expected)


def test_param_group_max_lr_and_multipliers():
    s = _scheduler("linear", start_wd=0.0, end_wd=0.1, wd_incr_style="linear")
    _lr_at(s, 60)
    group = s.optimizer.param_groups[1]
    assert group["lr"] == pytest.approx(2.0 * (0.05 + 0.5 * 0.45))   # own max/min lr, times lr_mult
    assert group["weight_decay"] == 0.0                                # wd_mult 0
    assert s.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.06)   # 0.1 * 60/100


@pytest.mark.parametrize("style, step, expected", [
    ("linear", 30, 0.03),
    ("cosine", 50, 0.05),
    ("cosine", 25, 0.1 * 0.5 * (1 + math.cos(0.75 * math.pi))),
    ("linear", 200, 0.1),
])
def test_weight_decay_increment(style, step, expected):
    s = _scheduler("constant", start_wd=0.0, end_wd=0.1, wd_incr_style=style)
    s.step(step)
    assert s.get_wd() == pytest.approx(expected)
    assert s.optimizer.param_groups[0]["weight_decay"] == pytest.approx(expected)


def test_state_dict_round_trip():
    s = _scheduler("cosine")
    s.step(35)
    state = s.state_dict()
    fresh = _scheduler("cosine")
    fresh.load_state_dict(state)
    assert fresh.num_steps == 35
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(s.optimizer.param_groups[0]["lr"])

    # use_checkpoint (default): the checkpoint's schedule wins.
    other = _scheduler("linear", max_lr=2.0)
    other.load_state_dict(state)
    assert other.lr_decay_style == "cosine" and other.max_lr == 1.0
    # override: the constructor's schedule wins, the step count still comes from the checkpoint.
    override = _scheduler("linear", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    override.load_state_dict(state)
    assert override.lr_decay_style == "linear" and override.num_steps == 35
    # neither: they must agree.
    strict = _scheduler("linear", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="lr_decay_style"):
        strict.load_state_dict(state)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="lr_decay_style"):
        _scheduler("square")
    with pytest.raises(ValueError, match="wsd_decay_steps"):
        _scheduler("WSD", lr_wsd_decay_style="linear")
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        _scheduler("linear", lr_warmup_steps=200)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_zero_weight_decay_steps_mean_end_wd_throughout(style):
    """wd_incr_steps = 0 (e.g. --train-iters 0): the ramp is already over, no division by zero."""
    s = _scheduler("constant", start_wd=0.0, end_wd=0.1, wd_incr_steps=0, wd_incr_style=style)
    assert s.get_wd() == 0.1
    assert s.optimizer.param_groups[0]["weight_decay"] == 0.1
    assert s.optimizer.param_groups[1]["weight_decay"] == 0.0      # wd_mult 0
    s.step(7)
    assert s.get_wd() == 0.1


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_reaches_end_wd_at_the_last_increment_step(style):
    s = _scheduler("constant", start_wd=0.02, end_wd=0.1, wd_incr_style=style)
    s.step(100)                                      # ratio 1: linear 1, cosine 0.5 * (cos 0 + 1) = 1
    assert s.get_wd() == pytest.approx(0.1)


def test_param_group_without_its_own_lr_uses_the_schedulers():
    """OptimizerConfig.min_lr defaults to None: such groups decay to the scheduler's min_lr."""
    from teratron.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1.0), [torch.nn.Linear(2, 2)])
    assert all(group["min_lr"] is None for group in optimizer.param_groups)
    s = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=10,
                                lr_decay_steps=110, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                wd_incr_steps=100, wd_incr_style="constant")
    s.step(60)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.55, 0.55])  # as in the table


def test_bad_steps_and_init_lr_raise():
    with pytest.raises(ValueError, match="wd_incr_steps"):
        _scheduler("constant", start_wd=0.0, end_wd=0.1, wd_incr_steps=-1, wd_incr_style="linear")
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        _scheduler("linear", lr_warmup_steps=-5)
    with pytest.raises(ValueError, match="init_lr"):
        _scheduler("linear", init_lr=-0.1)
