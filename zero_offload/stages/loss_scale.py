"""Dynamic loss scaling for float16: scale the loss up so small gradients survive in fp16,
skip a step whose gradients overflowed and halve the scale, double it after a window of
overflow-free steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["LossScaler"]

log = logging.getLogger(__name__)


@dataclass
class LossScaler:
    scale: float = 2.0**16
    window: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0
    skipped_steps: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            new = max(self.scale / 2, self.min_scale)
            log.warning(
                "float16 gradients overflowed: step skipped, loss scale %g -> %g", self.scale, new
            )
            self.scale = new
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
