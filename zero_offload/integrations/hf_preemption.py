"""``save_on_preemption=True`` under ``ZeroOffloadTrainer``: after the step the ranks agreed
to stop at, Trainer saves ``checkpoint-<global step>`` as it does at ``save_steps`` (so
``resume_from_checkpoint`` finds it), and the process exits with the signal's status."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..engine.engine import Engine
from .preemption import stop_after_save

__all__ = ["PreemptionCallback"]


class PreemptionCallback(TrainerCallback):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.engine.preempted:
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.engine.preempted:
            stop_after_save(self.engine, f"{args.output_dir}/checkpoint-{state.global_step}")
        return control
