"""``engine.optimizer.state_dict()`` / ``load_state_dict()`` the torch way, on every tier.

Trainers and users' own loops save an optimizer with ``optimizer.state_dict()``. The engine's
optimizer holds one parameter, this rank's rank-flat fp32 shard, and its state may live in
files, so the torch state would be empty or partial. Hooks (torch's public ones) fill it in:

    state[0] = {"step": tensor, "exp_avg": fp32[n], "exp_avg_sq": fp32[n],
                "master": fp32[n],  # the fp32 parameters the moments belong to
                "missed_updates": {name: k},  # updates a parameter had no gradient for
                "zero_offload": {"rank", "world_size", "stage", "numel", "policy"},
                "native": {name: tensor}}  # any policy but fp32 AdamW: see below

With another optimizer kind or state precision, ``master`` and the moments are its state as
fp32 (the master with its compensation term added, each moment dequantized; Lion's momentum
as ``exp_avg``, Adagrad's sum as ``exp_avg_sq``), and ``native`` holds the state as it is
stored (8-bit codes, absmax and side arrays, a bf16 master and its compensation), which
loading restores bit for bit. ``policy`` names the kind and precisions; a dict loads only
into an engine of the same policy.

The tensors are filled chunk by chunk as the tier streams them (sub-group by sub-group from
NVMe), so nothing but the returned dict is held whole. Loading streams them back unit by
unit and recomputes the compute-dtype parameters from the master; it is collective in the
stages that all-gather parameters (every rank loads its own rank's dict). A dict holds one
rank's shard: other world sizes or stages go through ``save_checkpoint``.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from ..checkpoint.checkpointable import Checkpointable

__all__ = ["attach_state_dict"]


class _OptimizerOwner(Checkpointable, Protocol):
    """What the hooks read and restore: a checkpointable run with its torch optimizer (the
    engine's state view satisfies it; this module never imports the engine)."""

    @property
    def trainable_numel(self) -> int: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def optimizer_steps(self) -> int: ...
    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None: ...
    def missed_updates(self) -> dict[str, int]: ...
    def load_missed_updates(self, by_name: dict[str, int]) -> None: ...


KEYS = ("master", "exp_avg", "exp_avg_sq")
_RESHARD = (
    "a zero_offload optimizer state dict holds one rank's shard and loads only on the "
    "same rank, world size and stage; use engine.save_checkpoint / "
    "engine.load_checkpoint to change those"
)


def _layout(engine: _OptimizerOwner) -> dict[str, int | str | list[str]]:
    policy = engine.state_policy
    layout: dict[str, int | str | list[str]] = {
        "rank": engine.comm.rank,
        "world_size": engine.comm.world_size,
        "stage": engine.stage,
        "numel": engine.trainable_numel,
        "policy": policy.describe(),
    }
    if policy.fp32_moments:
        layout["fp32_moments"] = sorted(policy.fp32_moments)
    return layout


def _live(ref: "weakref.ref[_OptimizerOwner]") -> _OptimizerOwner:
    engine = ref()
    if engine is None:
        raise RuntimeError("the engine of this optimizer is gone; its state went with it")
    return engine


def _state(engine: _OptimizerOwner) -> dict[str, Any]:
    """This rank's optimizer state as new CPU tensors, filled from the tier in pieces."""
    n = engine.trainable_numel
    out = {k: torch.empty(n, dtype=torch.float32) for k in KEYS}
    for lo, arrays in engine.state_chunks():
        if lo >= n:  # frozen units: parameters without optimizer state
            break
        for key, values in zip(KEYS, arrays):
            assert values is not None
            out[key][lo : lo + values.numel()].copy_(values)
    native = engine.native_state()
    extra = {} if native is None else {"native": {k: t.clone() for k, t in native.items()}}
    return {
        "step": torch.tensor(float(engine.optimizer_steps), dtype=torch.float32),
        **out,
        # each parameter's own step count is `step` minus its missed updates
        "missed_updates": engine.missed_updates(),
        "zero_offload": _layout(engine),
        **extra,
    }


def _check(engine: _OptimizerOwner, state_dict: dict) -> dict[str, Any]:
    """The one state entry of ``state_dict``, checked against this engine before anything
    is changed."""
    states = list(state_dict.get("state", {}).values())
    if len(states) != 1 or not isinstance(states[0], dict) or not {"step", *KEYS} <= set(states[0]):
        raise ValueError(
            "optimizer.load_state_dict: this is not a state dict of a zero_offload engine's "
            "optimizer (it needs one state entry with step, master, exp_avg, exp_avg_sq); "
            "checkpoints written by save_checkpoint load with engine.load_checkpoint"
        )
    entry = states[0]
    want, got = _layout(engine), entry.get("zero_offload")
    if got != want:
        raise ValueError(
            f"optimizer.load_state_dict: saved for {got}, this engine is {want}: {_RESHARD}"
        )
    for key in KEYS:
        t = entry[key]
        if (
            not isinstance(t, torch.Tensor)
            or t.shape != (want["numel"],)
            or t.dtype != torch.float32
        ):
            raise ValueError(
                f"optimizer.load_state_dict: {key} must be a float32 tensor of "
                f"{want['numel']} elements, got "
                f"{getattr(t, 'dtype', type(t).__name__)} "
                f"{tuple(getattr(t, 'shape', ()))}"
            )
    return entry


def _load(engine: _OptimizerOwner, entry: dict[str, Any]) -> None:
    for unit in sorted((u for u in engine.units if not u.frozen), key=lambda u: u.shard_offset):
        lo, hi = unit.shard_offset, unit.shard_offset + unit.shard_numel
        engine.load_unit_state(unit, *(entry[k][lo:hi].to("cpu") for k in KEYS))
    if "native" in entry:  # the state as it was stored, bit for bit
        engine.load_native_state(entry["native"])
    engine.finish_load()
    step = entry["step"]
    engine.optimizer_steps = int(step.item() if isinstance(step, torch.Tensor) else step)
    engine.load_missed_updates(dict(entry.get("missed_updates", {})))


def attach_state_dict(engine: _OptimizerOwner) -> None:
    """Make ``engine.optimizer.state_dict()`` return this rank's full optimizer state and
    ``load_state_dict`` restore it (torch then restores ``param_groups`` as usual). The
    hooks hold the engine weakly."""
    ref = weakref.ref(engine)
    pending: list[dict[str, Any]] = []

    def save(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        (index,) = state_dict["param_groups"][0]["params"]
        return {**state_dict, "state": {index: _state(_live(ref))}}

    def before_load(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        pending.clear()
        pending.append(_check(_live(ref), state_dict))
        return {**state_dict, "state": {}}  # torch keeps the param groups; we the tensors

    def after_load(optimizer: torch.optim.Optimizer) -> None:
        entry = pending.pop()
        _load(_live(ref), entry)

    optimizer = engine.optimizer
    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(before_load)
    optimizer.register_load_state_dict_post_hook(after_load)
