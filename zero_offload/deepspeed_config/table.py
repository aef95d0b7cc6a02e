"""What zero_offload does with every key of a DeepSpeed config: one table, decided once.

Each :class:`Key` is a DeepSpeed config key (dotted, as in ``zero_optimization.stage``) or a
whole section (``flops_profiler``: every key under it) with one :class:`Decision`:

- ``TRANSLATED``: it becomes :func:`zero_offload.initialize` keywords (through
  :func:`~.translate.translate`);
- ``ACCEPTED``: its job is done here already, or it does not change training; taken with one
  log line saying why it is not needed;
- ``REFUSED``: it would change training in a way zero_offload cannot honour; a
  :class:`~zero_offload.errors.ConfigError` says so, unless its value is one of ``off`` (the
  values that leave the feature off, accepted with a log line). A refused section is off when
  every ``enabled`` inside it is false.

``aliases`` are DeepSpeed's other names for the key (``stage3_max_live_parameters`` for
``max_live_parameters``); ``default`` is DeepSpeed's value when the key is absent, which is
also what ``"auto"`` means outside a trainer inside the sections DeepSpeed validates
(:data:`VALIDATED`). The decisions block of ``docs/deepspeed.md`` is :func:`markdown`'s output,
and a test checks that it is current.
"""

from __future__ import annotations

import json
from typing import Any

from .key import Decision, Key
from .keys_training import TRAINING_KEYS
from .keys_zero import ZERO_KEYS

__all__ = ["Decision", "Key", "KEYS", "VALIDATED", "counts", "find", "markdown"]

KEYS: tuple[Key, ...] = TRAINING_KEYS + ZERO_KEYS


# Sections DeepSpeed parses with its validating config models: "auto" in them is DeepSpeed's
# default (the models drop it), and a key they do not know is an error there too.
VALIDATED = (
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "compile",
    "comms_logger",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "hybrid_engine",
    "timers",
)

_BY_PATH: dict[str, Key] = {}
for _key in KEYS:
    for _name in (_key.path, *_key.aliases):
        assert _name not in _BY_PATH, _name
        _BY_PATH[_name] = _key


def find(path: str) -> Key | None:
    """The entry deciding ``path``: its own, or that of the nearest section above it."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        key = _BY_PATH.get(".".join(parts[:n]))
        if key is not None:
            return key
    return None


def counts() -> dict[str, int]:
    """How many entries of the table have each decision."""
    out = {d.value: 0 for d in Decision}
    for key in KEYS:
        out[key.decision.value] += 1
    return out


def markdown() -> str:
    """The table as the Markdown rows of ``docs/deepspeed.md``."""
    lines = ["| key | decision | what zero_offload does |", "|---|---|---|"]
    for key in KEYS:
        names = " ≡ ".join(f"`{n}`" for n in (key.path, *key.aliases))
        decision = key.decision.value
        if key.off:
            decision += " (accepted at " + ", ".join(f"`{_json(v)}`" for v in key.off) + ")"
        lines.append(f"| {names} | {decision} | {key.why} |")
    c = counts()
    lines.append("")
    lines.append(
        f"{len(KEYS)} entries: {c['translated']} translated, {c['accepted']} accepted, "
        f"{c['refused']} refused."
    )
    return "\n".join(lines) + "\n"


def _json(value: Any) -> str:
    return json.dumps(value)
