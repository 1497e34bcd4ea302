"""OptimizerParamScheduler: Megatron's learning-rate and weight-decay schedules.

Steps are whatever unit the caller counts in: Megatron's training loop calls
`step(increment=global_batch_size)`, so warm-up/decay lengths are in samples there. Each param
group may carry `max_lr`/`min_lr` (its own peak and floor; None means the scheduler's), `lr_mult`
and `wd_mult`.

LR: linear warm-up from init_lr to max_lr over lr_warmup_steps, then by lr_decay_style
('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD') down to min_lr at lr_decay_steps,
min_lr after. WSD ("warmup-stable-decay") holds max_lr and anneals over the last
wsd_decay_steps with lr_wsd_decay_style ('linear', 'cosine', 'exponential', 'minus_sqrt').
Weight decay: start_wd -> end_wd over wd_incr_steps ('constant', 'linear', 'cosine'), end_wd
from then on; wd_incr_steps = 0 (e.g. --train-iters 0) is a ramp already over: end_wd throughout.
"""

import math

_LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
_WD_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float,
                 wd_incr_steps: int, wd_incr_style: str, use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False, wsd_decay_steps: int | None = None,
                 lr_wsd_decay_style: str | None = None):
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self._validate()
        self.step(0)

    def _validate(self):
        if self.min_lr < 0.0 or self.max_lr < self.min_lr:
            raise ValueError(f"learning rates must satisfy 0 <= min_lr ({self.min_lr}) <= max_lr ({self.max_lr}); "
                             "fix --min-lr / --lr")
        if not 0.0 <= self.init_lr <= self.max_lr:
            raise ValueError(f"need 0 <= init_lr ({self.init_lr}) <= max_lr ({self.max_lr}); fix --lr-warmup-init")
        if self.lr_warmup_steps < 0 or self.lr_decay_steps <= 0 or self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(f"need 0 <= lr_warmup_steps ({self.lr_warmup_steps}) < lr_decay_steps "
                             f"({self.lr_decay_steps}); fix --lr-warmup-* / --lr-decay-*")
        if self.lr_decay_style not in _LR_STYLES:
            raise ValueError(f"lr_decay_style={self.lr_decay_style!r} is unknown; choose one of {_LR_STYLES}")
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.lr_decay_steps:
                raise ValueError(f"WSD needs 0 < wsd_decay_steps ({self.wsd_decay_steps}) <= lr_decay_steps "
                                 f"({self.lr_decay_steps}); set --lr-wsd-decay-samples/--lr-wsd-decay-iters")
            if self.lr_wsd_decay_style not in _WSD_STYLES:
                raise ValueError(f"lr_wsd_decay_style={self.lr_wsd_decay_style!r} is unknown; "
                                 f"choose one of {_WSD_STYLES}")
        if self.start_wd < 0.0 or self.end_wd < self.start_wd:
            raise ValueError(f"weight decay must satisfy 0 <= start_wd ({self.start_wd}) <= end_wd ({self.end_wd})")
        if self.wd_incr_steps < 0:
            raise ValueError(f"wd_incr_steps ({self.wd_incr_steps}) must be >= 0; fix --train-iters")
        if self.wd_incr_style not in _WD_STYLES:
            raise ValueError(f"wd_incr_style={self.wd_incr_style!r} is unknown; choose one of {_WD_STYLES}")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"wd_incr_style='constant' needs start_wd == end_wd, got {self.start_wd} and "
                             f"{self.end_wd}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set; "
                             "choose one")

    def get_wd(self) -> float:
        if self.num_steps >= self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group) -> float:
        max_lr = param_group.get("max_lr")
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = param_group.get("min_lr")
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / max(self.num_steps, 1) ** 0.5
            return max(min_lr, lr)
        ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff()
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self) -> float:
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        ratio = (self.num_steps - anneal_start) / self.wsd_decay_steps
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * 0.5 ** ratio - 1.0
        return 1.0 - math.sqrt(ratio)

    def step(self, increment: int) -> None:
        """Advance by `increment` steps and set every param group's lr and weight_decay."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    # ----- checkpoints --------------------------------------------------------------------------

    # The schedule a checkpoint records, and the `teratron train` flags that set each value
    # (steps count samples there). wsd_decay_steps and init_lr are not recorded, as in Megatron.
    _CHECKPOINTED = {
        "max_lr": "--lr", "min_lr": "--min-lr",
        "lr_warmup_steps": "--lr-warmup-iters/-samples or --lr-warmup-fraction; in samples",
        "lr_decay_steps": "--lr-decay-iters/-samples, default --train-iters/-samples; in samples",
        "lr_decay_style": "--lr-decay-style",
        "start_wd": "--start-weight-decay or --weight-decay", "end_wd": "--end-weight-decay or --weight-decay",
        "wd_incr_steps": "--train-iters/-samples; in samples", "wd_incr_style": "--weight-decay-incr-style",
    }

    def state_dict(self) -> dict:
        state = {name: getattr(self, name) for name in self._CHECKPOINTED}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at the checkpoint's step. Which schedule continues (Megatron's rule):
        override_opt_param_scheduler keeps this one, use_checkpoint_opt_param_scheduler takes the
        checkpoint's, and with neither a value that differs is an error naming it."""
        saved = {name: state_dict[name] for name in self._CHECKPOINTED if name in state_dict}
        if not self.override_opt_param_scheduler:
            differ = [f"{name} ({flag}) is {getattr(self, name)} now, {saved[name]} in the checkpoint"
                      for name, flag in self._CHECKPOINTED.items()
                      if name in saved and getattr(self, name) != saved[name]]
            if differ and not self.use_checkpoint_opt_param_scheduler:
                raise ValueError(f"the learning-rate/weight-decay schedule differs from the checkpoint's: {'; '.join(differ)}; "
                                 "pass --override-opt_param-scheduler to follow this command line's schedule or "
                                 "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
            for name, value in saved.items():
                setattr(self, name, value)
        self.num_steps = 0
        self.step(state_dict["num_steps"])
