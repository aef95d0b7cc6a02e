"""The vocabulary updaters share (what a step is given and reports), in a module of its own
so that none of them imports another to get it; the base class is :mod:`.updater`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ZeroConfig

__all__ = [
    "Sink",
    "StateChunk",
    "StepRange",
    "StepTimings",
    "Targets",
    "adam_hyperparameters",
    "adam_kwargs",
    "whole_range",
]


Sink = Callable[[int, int, torch.Tensor], None]
"""Receives the new parameter values of rank-flat elements [lo, hi) (fp32 or compute dtype),
in increasing order; it must be done with the tensor when it returns."""

Targets = Callable[[int, int], "tuple[int, int, torch.Tensor] | None"]
"""Where new compute-dtype values belong: the first piece of rank-flat [lo, hi) that has a
place, (a, b, view) with lo <= a < b <= hi and ``view`` holding elements [a, b), or None
(no more in [lo, hi)). An updater that takes them writes the piece's values there in place
and hands the piece to the sink before it asks for the next (a place may hold room that the
sink frees); elements with no place reach the sink as values."""


@dataclass
class StepTimings:
    """Seconds of the last update. ``read_s`` / ``write_s``: per-request durations summed
    (submit to completion; concurrent requests both count). ``io_busy_s``: time with at least
    one request in flight — the disk's share of the wall time. ``overlap`` =
    max(io_busy, compute) / wall: 1.0 when the slower of I/O and compute hides the other."""

    read_s: float = 0.0
    write_s: float = 0.0
    io_busy_s: float = 0.0
    compute_s: float = 0.0
    wall_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    early_groups: int = 0
    """NVMe sub-groups stepped during the final backward and adopted by this step."""
    param_copy_bytes: int = 0
    """Bytes of new compute-dtype parameter values copied on the host after the update
    computed them (0: written in place where they are stored)."""

    @property
    def overlap(self) -> float:
        busy = max(self.io_busy_s, self.compute_s)
        return busy / self.wall_s if self.wall_s > 0 else 1.0


StepRange = tuple[int, int, int, bool]
"""(lo, hi, step, decays): step rank-flat elements [lo, hi) at Adam step count ``step``, with
the group's weight decay when ``decays`` (else none: biases, norm weights)."""


def whole_range(numel: int, step: int) -> list[StepRange]:
    """Every element at ``step``, with weight decay: what ``ranges=None`` means."""
    return [(0, numel, step, True)]


StateChunk = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]
"""(lo, hi, master, exp_avg, exp_avg_sq) for rank-flat elements [lo, hi), fp32 on the CPU."""


def adam_hyperparameters(
    optimizer: torch.optim.Optimizer, step: int, num_threads: int | None
) -> dict:
    """Keyword arguments of :func:`~zero_offload.optim.adam_update` from the optimizer's
    first param group (read at every step: lr schedulers change it) and the caller's kernel
    threads."""
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    return dict(
        step=step,
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        adamw=True,
        num_threads=num_threads,
    )


def adam_kwargs(cfg: ZeroConfig) -> dict:
    o = cfg.optimizer
    return dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
