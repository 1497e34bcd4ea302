"""Loss scalers for fp16: a constant scale, or Megatron's dynamic scale with hysteresis."""

import torch


class MegatronGradScaler:
    """The loss is multiplied by `scale` before backward; grads are multiplied by `inv_scale`."""

    def __init__(self, initial_scale: float):
        if initial_scale <= 0:
            raise ValueError(f"initial loss scale must be positive, got {initial_scale}")
        self._scale = float(initial_scale)

    @property
    def scale(self) -> torch.Tensor:
        return torch.tensor(self._scale, dtype=torch.float32)

    @property
    def inv_scale(self) -> torch.Tensor:
        return torch.tensor(1.0 / self._scale, dtype=torch.float32)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = float(state_dict["scale"])


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (`--loss-scale`)."""


class DynamicGradScaler(MegatronGradScaler):
    """Halve the scale after `hysteresis` overflowing steps (not below `min_scale`); double it
    after `growth_interval` consecutive clean steps, which also restores the hysteresis."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"min loss scale {min_scale} must be in (0, initial scale {initial_scale}]")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor {growth_factor} must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor {backoff_factor} must be in (0, 1)")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("loss_scale_window (growth_interval) and hysteresis must be at least 1")
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
