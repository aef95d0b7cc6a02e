"""Dynamic loss scaling for float16: scale the loss up so small gradients survive in fp16,
skip a step whose gradients overflowed and halve the scale, double it after a window of
overflow-free steps. ``hysteresis`` > 1 lets the scale ride out that many overflows before
it halves (DeepSpeed's delayed shift); ``consecutive`` refills it at every good step rather
than after a whole window.

With a fixed scale of 1 (``dynamic=False``) the same class is the non-finite guard of bf16 and
fp32 training (``skip_nonfinite_steps``): a step whose gradients hold inf or NaN is skipped
and nothing else changes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["LossScaler"]

log = logging.getLogger(__name__)


@dataclass
class LossScaler:
    scale: float = 2.0**16
    window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 1
    consecutive: bool = False
    dynamic: bool = True
    good_steps: int = 0
    skipped_steps: int = 0
    hysteresis_left: int = field(default=0)

    def __post_init__(self) -> None:
        self.hysteresis_left = self.hysteresis_left or self.hysteresis

    @classmethod
    def guard(cls) -> LossScaler:
        """The non-finite guard: scale 1, never changed."""
        return cls(scale=1.0, dynamic=False)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if not self.dynamic:
                log.warning("non-finite gradients: step skipped")
            elif self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                log.warning(
                    "float16 gradients overflowed: step skipped, loss scale kept at %g "
                    "(%d more overflows before it halves)",
                    self.scale,
                    self.hysteresis_left - 1,
                )
            else:
                new = max(self.scale / 2, self.min_scale)
                log.warning(
                    "float16 gradients overflowed: step skipped, loss scale %g -> %g",
                    self.scale,
                    new,
                )
                self.scale = new
        elif self.dynamic:
            self.good_steps += 1
            if self.consecutive:
                self.hysteresis_left = self.hysteresis
            if self.good_steps % self.window == 0:
                self.scale *= 2
                self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        # checkpoints from before hysteresis start it full
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
