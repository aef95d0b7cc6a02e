"""What ``configure_optimizers`` returned, made the engine's: the optimizer's kind, state
precision and hyperparameters read from the user's optimizer, and its lr schedulers pointed
at the engine's parameter group."""

from __future__ import annotations

from typing import Any

import torch

from ..config import ConfigError
from .common import EngineOptimizer
from .optimizers import optimizer_keys

__all__ = ["check_covers", "hyperparameters", "retarget"]


# The hyperparameters each update has; the optimizers may keep others in their groups
# (bitsandbytes' Lion an eps of 0.0, its Adagrad betas of (0.0, 0.0)) that mean nothing to it.
_HYPER = {"lion": ("lr", "betas"), "adagrad": ("lr", "eps")}


def hyperparameters(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, Any]:
    """The engine's optimizer keywords from the optimizer ``configure_optimizers`` returned:
    its kind and state precision (``optimizers.optimizer_keys``) and hyperparameters. Its
    groups may differ only in weight decay, one value and 0 (the usual no-decay group of
    biases and norm weights: ``no_decay``)."""
    kind = optimizer_keys(optimizer)
    groups = optimizer.param_groups
    named = _HYPER.get(kind.get("optimizer_type", "adamw"), ("lr", "betas", "eps"))
    keys: tuple[str, ...] = tuple(k for k in named if k in groups[0])
    first: dict[str, Any] = {k: groups[0][k] for k in keys}
    decays = {g["weight_decay"] for g in groups} - {0.0}
    if any({k: g[k] for k in keys} != first for g in groups[1:]) or len(decays) > 1:
        raise ConfigError(
            "configure_optimizers returned parameter groups with different "
            "hyperparameters; zero_offload trains one group, with weight decay "
            "0 allowed for some parameters: use one lr, betas, eps and "
            "weight_decay"
        )
    first.update(kind)
    if "betas" in first:
        first["betas"] = tuple(first["betas"])
    first["weight_decay"] = decays.pop() if decays else 0.0
    if first["weight_decay"]:
        undecayed = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
        names = [n for n, p in module.named_parameters() if id(p) in undecayed]
        if names:
            first["no_decay"] = names
    return first


def check_covers(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> None:
    """Every trainable parameter must be in the optimizer: the engine steps them all, where
    plain Lightning leaves the others as they are (a ConfigError names them)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    left = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ConfigError(
            f"configure_optimizers returned an optimizer without the trainable parameters "
            f"{shown}: zero_offload steps every trainable parameter; put them in the "
            "optimizer, or freeze them with requires_grad_(False) before returning it"
        )


# Per-group lists torch's lr schedulers keep (one entry per parameter group of the optimizer
# they were built on).
_PER_GROUP = (
    "base_lrs",
    "_last_lr",
    "lr_lambdas",
    "min_lrs",
    "max_lrs",
    "base_momentums",
    "max_momentums",
)


def retarget(scheduler: Any, user: torch.optim.Optimizer, engine: EngineOptimizer) -> None:
    """Point a scheduler built on the user's optimizer at the engine's one group: the keys it
    added to the user's groups (``initial_lr``, ``max_lr``, ...) are copied, and its
    per-group lists keep the first group's entry (the groups share their lr). The schedulers
    a ``SequentialLR`` or ``ChainedScheduler`` steps are repointed too: they set the lr."""
    group = engine.param_groups[0]
    for key, value in user.param_groups[0].items():
        if key != "params" and key not in group:
            group[key] = value
    _repoint(scheduler, len(user.param_groups), engine)


def _repoint(scheduler: Any, n: int, engine: EngineOptimizer) -> None:
    for child in getattr(scheduler, "_schedulers", ()):
        _repoint(child, n, engine)
    for attr in _PER_GROUP:
        value = getattr(scheduler, attr, None)
        if n > 1 and isinstance(value, list) and len(value) == n:
            setattr(scheduler, attr, value[:1])
    scheduler.optimizer = engine
