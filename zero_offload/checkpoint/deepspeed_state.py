"""A DeepSpeed checkpoint's counters and hyperparameters in this library's extra-state layout
(``save._extra_state``): step counts, Adam hyperparameters, loss scale, lr scheduler state and
module buffers. DeepSpeed stores no RNG streams; a Hugging Face Trainer checkpoint keeps them
in its own files, which the Trainer restores itself."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..optim.policy import OptimizerKind
from .format import CheckpointError
from .source import one_param_group

__all__ = ["MOMENTS", "saved_kind", "training_state"]

log = logging.getLogger(__name__)

MOMENTS = {  # kind -> per moment, the state names DeepSpeed's or torch's optimizer uses
    OptimizerKind.ADAMW: (("exp_avg",), ("exp_avg_sq",)),
    OptimizerKind.ADAM: (("exp_avg",), ("exp_avg_sq",)),
    OptimizerKind.LION: (("exp_avg",),),
    OptimizerKind.ADAGRAD: (("exp_avg_sq", "sum"),),  # DeepSpeedCPUAdagrad, torch.optim.Adagrad
}


def saved_kind(states: dict, groups: list | None, config: dict[str, Any]) -> OptimizerKind:
    """The update rule the saving run used: from the moments it kept (Lion: exp_avg alone,
    Adagrad: one accumulator), torch's ``decoupled_weight_decay`` in the param groups (Adam
    vs AdamW), else the config's optimizer section as DeepSpeed reads it; AdamW otherwise
    (a client optimizer that records neither, such as DeepSpeedCPUAdam)."""
    first = next(iter(states.values()), None)
    keys = set(first) if isinstance(first, dict) else set()
    if "exp_avg_sq" in keys and "exp_avg" not in keys or "sum" in keys:
        return OptimizerKind.ADAGRAD
    if "exp_avg" in keys and "exp_avg_sq" not in keys:
        return OptimizerKind.LION
    flags = {g.get("decoupled_weight_decay") for g in groups or ()} - {None}
    if len(flags) == 1:
        return OptimizerKind.ADAMW if flags.pop() else OptimizerKind.ADAM
    section = config.get("optimizer") if isinstance(config, dict) else None
    if isinstance(section, dict):
        name = str(section.get("type", "")).lower()
        params = section.get("params") or {}
        if name == "adam" and params.get("adam_w_mode", True) is False:
            return OptimizerKind.ADAM
        if name in ("lion", "adagrad"):
            return OptimizerKind(name)
    return OptimizerKind.ADAMW


def _hyperparameters(groups: list[dict[str, Any]] | None, where: Path) -> list[dict[str, Any]]:
    if not groups:
        log.warning(
            "%s: the optimizer state has no param groups (DeepSpeed's elastic layout): lr, "
            "betas, eps and weight decay stay as the engine was configured",
            where,
        )
    return one_param_group(groups or [], where)


def _loss_scaler(model: dict[str, Any], optimizer: dict[str, Any]) -> dict[str, Any] | None:
    record = optimizer.get("loss_scaler")
    if record is None or not getattr(record, "dynamic", False):
        return None  # static scale (bf16, fp32): nothing for a dynamic scaler to resume
    cur_iter = int(getattr(record, "cur_iter", 0))
    last_overflow = int(getattr(record, "last_overflow_iter", -1))
    out = {
        "scale": float(record.cur_scale),
        "good_steps": max(0, cur_iter - last_overflow - 1),
        "skipped_steps": int(model.get("skipped_steps", 0)),
    }
    if getattr(record, "cur_hysteresis", None) is not None:  # overflows left before halving
        out["hysteresis_left"] = int(record.cur_hysteresis)
    return out


def _scheduler(state: Any, groups: list[dict[str, Any]]) -> Any:
    """DeepSpeed's own schedules save only ``last_batch_iteration`` (-1 before the first
    step): as a torch scheduler's state that is ``last_epoch``, the steps taken (what
    ``deepspeed_config.schedules.DeepSpeedSchedule`` counts), and the last lr is the groups'
    (the engine has one group). A torch scheduler's state passes as it is."""
    if isinstance(state, dict) and set(state) == {"last_batch_iteration"}:
        taken = int(state["last_batch_iteration"]) + 1
        out: dict[str, Any] = {"last_epoch": taken, "_step_count": taken + 1}
        if groups and "lr" in groups[0]:
            out["_last_lr"] = [groups[0]["lr"]]
        return out
    return state


def training_state(
    model: dict[str, Any],
    optimizer: dict[str, Any],
    param_groups: list[dict[str, Any]] | None,
    steps: dict[str, int],
    where: Path,
) -> dict[str, Any]:
    """The extra state of a DeepSpeed save from its model states file (``model``), rank 0's
    optimizer state dict and param groups, and each trainable parameter's Adam step count."""
    adam_steps = max(steps.values(), default=0)
    ds_steps = int(model.get("global_steps", 0))
    config = model.get("ds_config") or {}
    gas = int(config.get("gradient_accumulation_steps", 1) or 1)
    buffer_names = set(model.get("buffer_names") or ())
    module = model.get("module") or {}
    groups = _hyperparameters(param_groups, where)
    return {
        "micro_steps": ds_steps * gas,
        # DeepSpeed counts the steps skipped on fp16 overflow too; the engine counts applied ones
        "global_steps": ds_steps - int(model.get("skipped_steps", 0)),
        "optimizer_steps": adam_steps,
        "param_groups": groups,
        "loss_scaler": _loss_scaler(model, optimizer),
        "missed_updates": {n: adam_steps - k for n, k in steps.items() if k != adam_steps},
        "lr_scheduler": _scheduler(model.get("lr_scheduler"), groups),
        "buffers": {n: t for n, t in module.items() if n in buffer_names},
    }


def fit_scheduler_state(state: dict[str, Any], groups: int, where: str) -> dict[str, Any]:
    """An lr scheduler's state saved for a run with more param groups (Trainer's decay and
    no-decay groups under DeepSpeed or DDP) for the engine's ``groups``: every per-group list
    (``base_lrs``, ``_last_lr``, ``lr_lambdas``...) must hold one value, which each group takes."""
    saved = len(state.get("base_lrs") or ()) or groups
    if saved == groups:
        return state
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, list) and len(value) == saved:
            if any(v != value[0] for v in value):
                raise CheckpointError(
                    f"{where}: the lr scheduler drove {saved} param groups with different "
                    f"{key} ({value}); the engine has {groups} (one lr for all parameters)"
                )
            out[key] = value[:1] * groups
    return out
