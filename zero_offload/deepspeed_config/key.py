"""One entry of the DeepSpeed key table: a key (or a whole section), its :class:`Decision`,
why, DeepSpeed's other names for it, the values that leave it off, and DeepSpeed's default.
The reasons several entries share are named here once."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Decision", "Key"]


class Decision(enum.Enum):
    TRANSLATED = "translated"
    ACCEPTED = "accepted"
    REFUSED = "refused"


@dataclass(frozen=True)
class Key:
    path: str
    decision: Decision
    why: str
    aliases: tuple[str, ...] = ()
    off: tuple[Any, ...] = ()
    default: Any = None


T, A, R = Decision.TRANSLATED, Decision.ACCEPTED, Decision.REFUSED
ZERO = "zero_optimization."
OFFLOAD_OPTIMIZER = ZERO + "offload_optimizer."
OFFLOAD_PARAM = ZERO + "offload_param."

# reasons shared by several keys
SIZED = "zero_offload sizes its buffers, I/O and threads from the model and the memory budget"
FREED = "gathered parameters are freed as soon as their module has run"
GATHER_SAVE = "save_model, full_state_dict() and consolidate_checkpoint gather the fp32 masters"
COMM = "a choice of collective: the same sums, reduced as zero_offload schedules them"
ROUNDING = "where the 1/world factor of the average is applied changes only rounding"
LOGS = "zero_offload logs through Python logging and your trainer's loggers (engine.last_step)"
TORCH_IMPL = "an implementation choice of torch's AdamW: zero_offload runs its own AdamW kernels"
MODEL_BUILT = "for modules a model builds from DeepSpeed; zero_offload trains the model as it is"
BATCH = (
    "with the other batch keys and the world size it gives gradient_accumulation_steps, as in "
    "DeepSpeed (and is checked against them); the batch itself is your data loader's"
)
