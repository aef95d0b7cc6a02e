"""What every trainer integration hands its trainer: the engine as a torch optimizer, and its
last step's stats as log entries (TensorBoard, W&B, CSV, ...)."""

from __future__ import annotations

from typing import Callable, NoReturn, overload

import torch

from ..engine.engine import Engine

__all__ = ["EngineOptimizer", "step_stats"]

STATS_PREFIX = "zero_offload/"


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer a trainer sees: the engine's ``param_groups`` (its lr schedulers drive
    them) and ``step`` (reduce, unscale, clip, update). Its state is in the engine's
    checkpoints, not in ``state_dict()`` (with NVMe it is not in memory at all)."""

    def __init__(self, engine: Engine) -> None:  # no super().__init__: the engine owns params
        self.engine = engine
        self.applied = True  # the last step updated the parameters
        self.overflowed = False  # the last step was skipped on an fp16 overflow

    # Read-only views where torch declares plain attributes: the engine's optimizer may
    # replace its param_groups list (load_state_dict), and the state is not held here.
    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.engine.optimizer.param_groups

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.engine.optimizer.defaults

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {}

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("zero_offload's optimizer step takes no closure")
        before = self.engine.skipped_steps
        self.applied = self.engine.step()
        self.overflowed = self.engine.skipped_steps > before

    @property
    def step_was_skipped(self) -> bool:
        """The last step was skipped on an fp16 overflow: a trainer then leaves its lr
        scheduler where it is, as with DeepSpeed (Accelerate reads this name)."""
        return self.overflowed

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine's step drops the gradients it applied."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            raise ValueError(
                "zero_offload's optimizer state is restored with the engine "
                "checkpoint (the trainer's resume), not load_state_dict"
            )

    def __repr__(self) -> str:
        return f"EngineOptimizer(stage={self.engine.stage})"


def step_stats(engine: Engine) -> dict[str, float]:
    """``engine.last_step`` under ``zero_offload/`` names, and the gradient norm (before
    clipping) under the ``grad_norm`` name trainers use."""
    stats = dict(engine.last_step)
    out = {STATS_PREFIX + k: v for k, v in stats.items()}
    if "grad_norm" in stats:
        out["grad_norm"] = stats["grad_norm"]
    return out
