"""The CPU Adam over a run of rank-flat elements, stepping only the ranges a step names.

A step names ranges (:data:`~.update_api.StepRange`): each with its own Adam step count (a
parameter that missed updates has its own) and weight decay (none for biases and norms);
elements outside every range keep their values. The host updater and the NVMe pipeline both
step their state with :func:`adam_over_ranges`, so where the state lives changes no bit."""

from __future__ import annotations

import torch

from ..optim import adam_update
from .api import StepRange

__all__ = ["adam_over_ranges"]


def adam_over_ranges(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    start: int,
    ranges: list[StepRange],
    hyper: dict,
    factor: float,
    out: torch.Tensor | None = None,
    chunk: int | None = None,
) -> None:
    """Step the elements of rank-flat [start, start + n) that ``ranges`` name; the four
    state tensors (and ``out``) hold exactly those n elements. ``out``: where the new
    compute-dtype values go (the kernel writes them in the same pass; elements not stepped
    get the master as it is). ``chunk``: elements per kernel call when ``grad`` is on an
    accelerator (each call copies its slice to the host); None: one call per range."""
    end = start + master.numel()
    done = start
    for lo, hi, count, decays in ranges:
        lo, hi = max(lo, start), min(hi, end)
        if lo >= hi:
            continue
        _copy_master(master, out, done - start, lo - start)
        kw = dict(hyper, step=count, weight_decay=hyper["weight_decay"] if decays else 0.0)
        per_call = chunk or hi - lo
        for a in range(lo - start, hi - start, per_call):
            b = min(a + per_call, hi - start)
            adam_update(
                master[a:b],
                grad[a:b].to("cpu"),
                exp_avg[a:b],
                exp_avg_sq[a:b],
                out=None if out is None else out[a:b],
                grad_scale=factor,  # scaled in registers
                **kw,
            )
        done = hi
    _copy_master(master, out, done - start, end - start)


def _copy_master(master: torch.Tensor, out: torch.Tensor | None, a: int, b: int) -> None:
    """Elements [a, b) not stepped: their compute-dtype values are the master, as it is."""
    if out is not None and a < b:
        out[a:b].copy_(master[a:b])
