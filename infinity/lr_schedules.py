"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR), same parameters and curves.

Each sets ``lr`` on every param group of the optimizer at construction (the step-0 value) and on each
step(). The engine calls step() once per optimizer step, as DeepSpeed does.
"""

from __future__ import annotations

import math

from infinity.errors import ConfigError


class _Schedule:
    def __init__(self, optimizer, warmup_num_steps: int, warmup_type: str) -> None:
        if warmup_type not in ("log", "linear"):
            raise ConfigError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        if warmup_num_steps < 1:
            raise ConfigError(f"scheduler.params.warmup_num_steps must be >= 1, got {warmup_num_steps}")
        self.optimizer = optimizer
        self.warmup_num_steps = warmup_num_steps
        self.warmup_type = warmup_type
        self.last_batch_iteration = 0
        self._apply()

    def _warmup_fraction(self, step: int) -> float:
        if self.warmup_type == "log":
            return math.log(step + 1) / math.log(self.warmup_num_steps) if self.warmup_num_steps > 1 else 1.0
        return step / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()


class WarmupLR(_Schedule):
    """min_lr -> max_lr over warmup_num_steps (log or linear), then constant max_lr."""

    def __init__(
        self,
        optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        self.min_lr, self.max_lr = float(warmup_min_lr), float(warmup_max_lr)
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def _gamma(self, step: int) -> float:
        return self._warmup_fraction(step) if step < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma(self.last_batch_iteration)
        return [lr] * len(self.optimizer.param_groups)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return self._warmup_fraction(step)
        return max(0.0, (self.total_num_steps - step) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Ratios of the optimizer's own lr: warmup_min_ratio -> 1 over the warmup, then a cosine to cos_min_ratio."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
    ) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def _ratio(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup_fraction(step)
        done = step - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1.0 + math.cos(math.pi * min(done, span) / span)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self._ratio(self.last_batch_iteration)
        return [base * ratio for base in self.base_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_schedule(scheduler_config, optimizer):
    cls = SCHEDULES[scheduler_config.type]
    try:
        return cls(optimizer, **scheduler_config.params)
    except TypeError as e:
        raise ConfigError(f"scheduler.params for {scheduler_config.type}: {e}") from None
