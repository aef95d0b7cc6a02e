"""DeepSpeed's lr schedules (the ``scheduler`` section of its config) as torch lr schedulers.

A DeepSpeed run steps its schedule once per optimizer step, starting from iteration -1 (the
first step runs at the schedule's start value, ``warmup_min_lr`` for WarmupLR); the
schedulers here follow the same formulas and the same count, so a recipe's learning rate is
the one it had under DeepSpeed. ``ZeroOffloadTrainer`` and ``ZeroOffloadStrategy`` build them
from a DeepSpeed config; in a loop of your own::

    sched = ds_schedules.lr_scheduler(engine.optimizer, "ds_config.json")
    ...; engine.step(); sched.step()

``initialize(model, config=...)`` with a ``scheduler`` section runs it the same way:
``engine.lr_scheduler``, stepped after each applied update and saved with the checkpoints.
WarmupLR, WarmupDecayLR and WarmupCosineLR are supported; OneCycle and LRRangeTest are a
:class:`ConfigError`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..errors import ConfigError

__all__ = ["DeepSpeedSchedule", "lr_scheduler", "schedule", "check_schedule", "SCHEDULES"]

# parameter -> DeepSpeed's default (None: required)
SCHEDULES: dict[str, dict[str, Any]] = {
    "WarmupLR": dict(
        warmup_min_lr=0.0, warmup_max_lr="lr", warmup_num_steps=1000, warmup_type="log"
    ),
    "WarmupDecayLR": dict(
        total_num_steps=None,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps=1000,
        warmup_type="log",
    ),
    "WarmupCosineLR": dict(
        total_num_steps=None,
        warmup_min_ratio=0.0,
        warmup_num_steps=1000,
        cos_min_ratio=0.0001,
        warmup_type="log",
    ),
}


class DeepSpeedSchedule(LRScheduler):
    """One of DeepSpeed's schedules; ``last_epoch`` counts steps taken, so DeepSpeed's
    ``last_batch_iteration`` is ``last_epoch - 1``."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, **params: Any) -> None:
        if kind not in SCHEDULES:
            raise ConfigError(
                f"DeepSpeed config key 'scheduler.type'={kind!r} is not supported: zero_offload "
                f"runs {', '.join(SCHEDULES)}; or remove the scheduler and use a torch one"
            )
        allowed = SCHEDULES[kind]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ConfigError(
                f"DeepSpeed config key 'scheduler.params.{unknown[0]}' is not a parameter of "
                f"{kind} (it takes {', '.join(allowed)})"
            )
        values = {**allowed, **params}
        for name, value in values.items():
            if value is None:
                raise ConfigError(f"DeepSpeed {kind} needs scheduler.params.{name}")
        steps = values["warmup_num_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise ConfigError(
                f"DeepSpeed config key 'scheduler.params.warmup_num_steps'={steps!r}: expected "
                "a positive integer"
            )
        if values["warmup_type"] not in ("log", "linear"):
            raise ConfigError(
                f"DeepSpeed config key 'scheduler.params.warmup_type'="
                f"{values['warmup_type']!r}: expected 'log' or 'linear'"
            )
        self.kind = kind
        self.params = values
        self.warmup = max(2, steps)  # DeepSpeed's floor
        super().__init__(optimizer)

    def _gamma(self, it: int) -> float:
        """The warmup's rise at DeepSpeed iteration ``it`` (0 at 0, 1 at the end)."""
        if self.params["warmup_type"] == "log":
            return math.log(it + 1) / math.log(self.warmup)
        return it / self.warmup

    def _lr(self, it: int, base: float) -> float:
        p = self.params
        if self.kind == "WarmupCosineLR":
            return base * self._ratio(it)
        top = base if p["warmup_max_lr"] == "lr" else float(p["warmup_max_lr"])
        low = float(p["warmup_min_lr"])
        if it < 0:
            return low
        if it < self.warmup:
            gamma = self._gamma(it)
        elif self.kind == "WarmupDecayLR":
            total = p["total_num_steps"]
            gamma = max(0.0, (total - it) / max(1.0, total - self.warmup))
        else:
            gamma = 1.0
        return low + (top - low) * gamma

    def _ratio(self, it: int) -> float:
        p = self.params
        if it < 0:
            return 0.0
        if it < self.warmup:
            low = p["warmup_min_ratio"]
            return low + self._gamma(it) * (1.0 - low)
        progress = min(1.0, (it - self.warmup + 1) / max(1, p["total_num_steps"] - self.warmup))
        floor = p["cos_min_ratio"]
        return max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self._lr(self.last_epoch - 1, float(base)) for base in self.base_lrs]


def lr_scheduler(
    optimizer: torch.optim.Optimizer,
    config: Mapping[str, Any] | str | os.PathLike,
    resolve: Mapping[str, Any] | None = None,
) -> DeepSpeedSchedule:
    """The schedule of a DeepSpeed config's ``scheduler`` section (a dict or JSON file) on
    ``optimizer``; ``resolve`` fills its ``"auto"`` values by parameter name (what a trainer
    knows)."""
    if isinstance(config, Mapping):
        data: Mapping[str, Any] = config
    else:
        with open(config) as f:
            data = json.load(f)
    section = data.get("scheduler")
    if not isinstance(section, Mapping) or "type" not in section:
        raise ConfigError("DeepSpeed config has no 'scheduler' section with a 'type'")
    params = dict(section.get("params") or {})
    for name, value in params.items():
        if value == "auto":
            if not resolve or name not in resolve:
                raise ConfigError(
                    f"DeepSpeed config key 'scheduler.params.{name}' is \"auto\" and nothing "
                    "fills it in here: give it a value (initialize: or pass lr_schedule= the "
                    "section with values)"
                )
            params[name] = resolve[name]
    return DeepSpeedSchedule(optimizer, str(section["type"]), **params)


def schedule(
    optimizer: torch.optim.Optimizer, section: Mapping[str, Any] | None
) -> DeepSpeedSchedule | None:
    """The engine's schedule from its ``lr_schedule`` keyword (a ``scheduler`` section)."""
    return None if section is None else lr_scheduler(optimizer, {"scheduler": section})


def check_schedule(section: Any, lr: float) -> None:
    """Validate an ``lr_schedule`` keyword up front, on a stand-in optimizer."""
    if not isinstance(section, Mapping) or "type" not in section:
        raise ConfigError(
            f"lr_schedule={section!r}: expected DeepSpeed's scheduler section, "
            '{"type": "WarmupLR", "params": {...}}'
        )
    params = section.get("params")
    for key, value in params.items() if isinstance(params, Mapping) else ():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"lr_schedule params {key}={value} is not valid: expected a finite number"
            )
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule(probe, section)
