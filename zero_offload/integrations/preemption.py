"""``save_on_preemption`` under a Trainer: the Trainer saves its own checkpoint, then the run
exits with the signal's status (``zero_offload.engine.preemption``).

The engine agrees with the other ranks at ``step()``; what is saved and where is the
Trainer's: Hugging Face's ``output_dir/checkpoint-<global step>`` (``resume_from_checkpoint``,
``True`` included, finds it) and Lightning's ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``
(the file Lightning's own SLURM requeue writes: ``ckpt_path="hpc"`` resumes it, or pass its
path). A folder given as the keyword's value would be a second place to look: refused.
"""

from __future__ import annotations

import logging
from typing import Any

from ..engine.engine import Engine
from ..engine.preemption import exit_status
from ..errors import ConfigError

__all__ = ["check_trainer_preemption", "stop_after_save"]

log = logging.getLogger(__name__)


def check_trainer_preemption(engine: Engine, trainer: str) -> bool:
    """Whether the engine agrees on preemption; a folder is refused under a Trainer."""
    value = engine.config.save_on_preemption
    if isinstance(value, str):
        raise ConfigError(
            f"save_on_preemption={value!r}: under {trainer} the Trainer saves its own "
            "checkpoint folder on preemption, which its resume finds; pass "
            "save_on_preemption=True"
        )
    return engine.preemption is not None


def stop_after_save(engine: Engine, where: Any, hand_back: bool = False) -> None:
    """The Trainer saved after an agreed preemption: end the process as the signal would.
    ``hand_back``: the model gets its values back first (for a Trainer whose teardown moves
    the module, as Lightning's does); otherwise stage 3's parameters are left empty."""
    signum = engine.preempted
    log.warning("preempted: the Trainer saved %s; exiting with status %d", where, 128 + signum)
    engine.close(hand_back=hand_back)
    raise SystemExit(exit_status(signum))
