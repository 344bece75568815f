"""Mixed precision: the compute dtype and the fp16 loss scaler (DeepSpeed's dynamic scaling semantics)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.config import Config, Fp16Config


def compute_dtype(config: Config) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[config.compute_dtype_name]


@dataclass(slots=True)
class LossScaler:
    """fp16 loss scaling with DeepSpeed's dynamic rule.

    A fixed scale never changes. A dynamic one: an overflow halves the scale (never below min_scale) once the
    hysteresis budget is down to 1, else spends one unit of it; after ``window`` steps since the last overflow
    the scale doubles and the budget refills (with consecutive_hysteresis, every clean step refills it).
    """

    scale: float
    dynamic: bool
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    _hysteresis_left: int = 2
    _iteration: int = 0
    _last_overflow: int = -1

    @classmethod
    def from_config(cls, fp16: Fp16Config) -> LossScaler:
        if not fp16.enabled:
            return cls(scale=1.0, dynamic=False)
        if fp16.loss_scale > 0:
            return cls(scale=fp16.loss_scale, dynamic=False)
        return cls(
            scale=2.0**fp16.initial_scale_power,
            dynamic=True,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            min_scale=fp16.min_loss_scale,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            _hysteresis_left=fp16.hysteresis,
        )

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._iteration
        else:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            if (self._iteration - self._last_overflow) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self._iteration += 1

    def state_dict(self) -> dict:
        return {
            "dynamic": self.dynamic,
            "scale": self.scale,
            "hysteresis_left": self._hysteresis_left,
            "iteration": self._iteration,
            "last_overflow": self._last_overflow,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what state_dict() returned (a resumed run scales its next steps as the saved one would)."""
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._iteration = int(state["iteration"])
        self._last_overflow = int(state["last_overflow"])
