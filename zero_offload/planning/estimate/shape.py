"""What the estimate reads from a model: its parameter counts (:class:`ModelShape`) and the
element counts of its units (:class:`~.terms.Layout`), laid out as the engine lays them out
(``plan_units``) for a model, or from a parameter count without padding."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ...grads.reducer import reductions_alive
from ...params.module_units import gathered_units
from ...params.units import owning_modules, plan_units, trainable_numel
from ...partition import padded_numel
from ...policies import Stage
from ...swap.buffers import ALIGNMENT, round_up
from .terms import Layout

__all__ = ["ModelShape", "model_layout", "count_layout"]

_DEFAULT_LARGEST_FRACTION = 50  # no model given: assume the largest module holds Ψ/50 params


@dataclass(frozen=True)
class ModelShape:
    """Only what the estimate needs from a model: sizes of its parameters and units, and
    how many train. With a model, the model itself (only its shapes and ``requires_grad``
    flags are read), so that the engine's ``plan_units`` lays out the units."""

    num_params: int
    trainable_params: int
    module_sizes: tuple[int, ...] | None = None  # params each module owns
    param_sizes: tuple[int, ...] | None = None  # every parameter, in registration order
    model: nn.Module | None = field(default=None, compare=False, repr=False)
    # the engine's unit layouts of ``model`` by layout arguments: a planner asks for the same
    # few dozen times (one ModelShape serves one search; a model changed after it was read
    # needs a new one)
    layouts: dict[tuple, "Layout"] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        model_or_num_params: nn.Module | int | float | "ModelShape",
        trainable_params: int | float | None = None,
    ) -> "ModelShape":
        """Read a model's parameter shapes and ``requires_grad`` flags (no memory touched:
        meta models work) or take a parameter count, of which ``trainable_params`` train
        (default: all)."""
        if (
            isinstance(model_or_num_params, (ModelShape, nn.Module))
            and trainable_params is not None
        ):
            raise ValueError(
                "trainable_params goes with a parameter count; a model says "
                "which parameters train by their requires_grad"
            )
        if isinstance(model_or_num_params, ModelShape):
            return model_or_num_params
        if isinstance(model_or_num_params, nn.Module):
            groups = [[p for _, p in own] for _, own in owning_modules(model_or_num_params)]
            params = [p for g in groups for p in g]
            if not params:
                raise ValueError("the model has no parameters")
            return cls(
                sum(p.numel() for p in params),
                sum(p.numel() for p in params if p.requires_grad),
                tuple(sum(p.numel() for p in g) for g in groups),
                tuple(p.numel() for p in params),
                model_or_num_params,
            )
        if not _is_count(model_or_num_params):
            raise TypeError(
                "expected a torch.nn.Module or a parameter count, got "
                f"{type(model_or_num_params).__name__}"
            )
        n = int(round(model_or_num_params))
        if n < 1:
            raise ValueError(f"parameter count must be positive, got {model_or_num_params!r}")
        if trainable_params is None:
            return cls(n, n)
        if not _is_count(trainable_params):
            raise TypeError(
                f"trainable_params must be a parameter count, got {type(trainable_params).__name__}"
            )
        t = int(round(trainable_params))
        if not 0 <= t <= n:
            raise ValueError(
                f"trainable_params must be between 0 and the parameter count "
                f"({n}), got {trainable_params!r}"
            )
        return cls(n, t)


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def model_layout(
    model: nn.Module,
    *,
    stage: Stage,
    num_gpus: int,
    shards: int,
    b: int,
    prefetch_depth: int,
    largest_layer_params: int | None,
    reduce_bucket_size: int,
) -> Layout:
    """The engine's own layout (``plan_units``): units, each padded."""
    plans = plan_units(model, stage=stage, world_size=num_gpus, bucket_size=reduce_bucket_size)
    padded = [p.layout.padded_numel for p in plans]
    full, largest = sum(padded), max(padded)
    # stage 3 gathers prefetch_depth + 1 units at a time: at most the largest ones
    window = sum(sorted(padded, reverse=True)[: gathered_units(prefetch_depth)])
    if stage.shards_params and largest_layer_params is not None:
        largest = padded_numel(largest_layer_params, shards)
        window = gathered_units(prefetch_depth) * largest
    # gradients are reduced, and stepped, for trainable units only
    trained = sorted((p.layout.padded_numel for p in plans if not p.frozen), reverse=True)
    largest_t = trained[0] if trained else 0
    inflight = sum(trained[: reductions_alive()])
    s, s_t = sum(p.shard_numel for p in plans), trainable_numel(plans)
    # on NVMe each unit's shard is a file of whole 4 KiB blocks (direct I/O)
    s_files = sum(round_up(b * p.shard_numel, ALIGNMENT) for p in plans)
    return Layout(plans, full, largest, largest_t, window, inflight, s, s_t, s_files)


def count_layout(
    shape: ModelShape,
    *,
    stage: Stage,
    shards: int,
    b: int,
    prefetch_depth: int,
    largest_layer_params: int | None,
    reduce_bucket_size: int,
) -> Layout:
    """A parameter count: no padding, and the largest module assumed when not given."""
    psi, psi_t = shape.num_params, shape.trainable_params
    full = psi
    largest = (
        largest_layer_params or max(1, psi // _DEFAULT_LARGEST_FRACTION)
        if stage.shards_params
        else min(reduce_bucket_size, psi)
    )
    largest_t = min(largest, psi_t)
    inflight = reductions_alive() * largest_t
    window = gathered_units(prefetch_depth) * largest
    s, s_t = math.ceil(full / shards), math.ceil(psi_t / shards)
    s_files = b * s
    return Layout(None, full, largest, largest_t, window, inflight, s, s_t, s_files)
