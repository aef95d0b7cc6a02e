"""What the ranks agree on before an update: which parameters had a gradient on any rank, and
so which rank-flat ranges the updater steps and at which Adam step counts, and the global sum
of squares of the gradients (the overflow check and the clipping norm).

Like ``torch.optim.AdamW``, a parameter that had no gradient in the accumulation window (on
any rank) is not stepped: no moment update, no weight decay, and its own step count does not
advance. :class:`GradPrep` counts the updates each parameter missed, and names the ranges to
step, each with its count; in the common case (every parameter had a gradient every time)
that is one range. Parameters named in ``no_decay`` (biases, norm weights) are stepped with
weight decay 0, as in the no-decay parameter group of Hugging Face Trainer's AdamW: their
ranges say so.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch._subclasses.fake_tensor import is_fake

from ..comm import Comm
from ..config import ConfigError, ZeroConfig
from ..device.streams import Streams
from ..grads.reducer import trainable_slots
from ..grads.slices import sum_of_squares
from ..params.units import FlatUnit
from .api import StepRange
from .updater import Updater

__all__ = ["GradPrep"]


def _decays(
    units: list[FlatUnit], slots: list[tuple[FlatUnit, int]], no_decay: tuple[str, ...]
) -> list[bool]:
    """Per trainable slot: whether weight decay applies (its name is not in ``no_decay``)."""
    names = {n for u in units for n in u.names}
    unknown = [n for n in no_decay if n not in names]
    if unknown:
        close = ", ".join(sorted(names)[:5])
        raise ConfigError(
            f"no_decay names {unknown[:3]!r}, which are not parameters of the "
            f"model; use names from model.named_parameters() (e.g. {close})"
        )
    skip = set(no_decay)
    return [u.names[i] not in skip for u, i in slots]


class GradPrep:
    """Per trainable parameter (``grads.trainable_slots`` order): its name, this rank's
    rank-flat elements of it, whether it decays, and the updates it missed (no gradient on
    any rank); and the one all-reduce a step makes to agree on them."""

    def __init__(
        self,
        units: list[FlatUnit],
        cfg: ZeroConfig,
        comm: Comm,
        device: torch.device,
        streams: Streams,
        updater: Updater,
    ) -> None:
        self.comm = comm
        self.stage = cfg.sharding
        self.device = device  # scalars for collectives live here (NCCL needs device tensors)
        self.streams = streams
        self.updater = updater
        slots = trainable_slots(units)
        self.names = [u.names[i] for u, i in slots]
        self._ranges = [self._rank_flat_range(u, i) for u, i in slots]
        self.skipped = [0] * len(slots)  # per parameter: the updates it missed
        self._decays = _decays(units, slots, cfg.optimizer.no_decay)
        self._host_vec: torch.Tensor | None = None  # what the step's exchange sends

    def _rank_flat_range(self, unit: FlatUnit, i: int) -> tuple[int, int]:
        """This rank's rank-flat [lo, hi) of parameter ``i`` of ``unit`` (the padding after
        a parameter goes with it, so that neighbours stay contiguous); empty if none."""
        slots = unit.layout.slots
        start = 0 if i == 0 else slots[i].offset
        end = slots[i + 1].offset if i + 1 < len(slots) else unit.layout.padded_numel
        lo, hi = unit.layout.shard_range(0 if unit.layout.num_shards == 1 else self.comm.rank)
        a, b = max(start, lo), min(end, hi)
        return (unit.shard_offset + a - lo, unit.shard_offset + b - lo) if a < b else (0, 0)

    def update_ranges(self, had_grad: list[bool] | None) -> list[StepRange] | None:
        """(lo, hi, step, decays) runs of rank-flat elements to step, neighbours with equal
        step counts and weight decay merged; counts the update as missed by every parameter
        without a gradient. None: all, at the next step count, with weight decay."""
        if had_grad is None:
            if all(self._decays):
                return None
            had_grad = [True] * len(self._ranges)
        step = self.updater.steps + 1
        ranges: list[StepRange] = []
        for k, ((lo, hi), had) in enumerate(zip(self._ranges, had_grad)):
            if not had:
                self.skipped[k] += 1
                continue
            s, decays = step - self.skipped[k], self._decays[k]
            if lo == hi:
                continue
            if ranges and ranges[-1][1] == lo and ranges[-1][2:] == (s, decays):
                ranges[-1] = (ranges[-1][0], hi, s, decays)
            else:
                ranges.append((lo, hi, s, decays))
        return ranges

    def all_ranges(self) -> list[StepRange] | None:
        """Every parameter with a gradient, each at its own step count: what the step
        computes when that is so (a pass during backward steps these, and the step
        compares)."""
        return self.update_ranges([True] * len(self._ranges))

    def missed_updates(self) -> dict[str, int]:
        """Parameter name -> updates it was not stepped in (no gradient); nonzero ones only.
        Its own Adam step count is ``updater.steps`` minus this."""
        return {n: k for n, k in zip(self.names, self.skipped) if k}

    def load_missed_updates(self, by_name: Mapping[str, int]) -> None:
        self.skipped = [int(by_name.get(n, 0)) for n in self.names]

    def _local_sumsq(self, grads: torch.Tensor | None) -> torch.Tensor:
        """This rank's sum of squares of its reduced gradient shard, in fp64 on every device
        (so that the per-sub-group sums of gradients in files and the sum over a resident
        shard agree far below the fp32 clip factor's last bit), without a copy of the shard
        and without a wait; infinite or NaN when a gradient is (the overflow check)."""
        if self.updater.disk_grads is not None:
            sumsq, finite = self.updater.disk_grads.stats()
            return torch.tensor(sumsq if finite else math.inf, dtype=torch.float64)
        assert grads is not None  # not in files: in memory
        return sum_of_squares(grads)

    def exchange(
        self, flags: torch.Tensor | None, grads: torch.Tensor | None, stats: bool
    ) -> list[float]:
        """One all-reduce (sum) and one host read per step: the ranks' gradient flags and,
        with ``stats`` (clipping or float16), the sum of squares of ``grads`` as the last
        element."""
        n = 0 if flags is None else flags.numel()
        if self._host_vec is None or self._host_vec.numel() != n + 1:
            # page-locked with CUDA: its copy to the device waits for no kernel
            self._host_vec = self.streams.host_empty(n + 1, torch.float64)
        self._host_vec.zero_()
        if flags is not None:
            self._host_vec[:n].copy_(flags)
        vec = self._host_vec.to(self.device, non_blocking=True)
        if stats and (self.stage.sharded or self.comm.rank == 0):  # stage 0: every rank holds
            vec[n] = self._local_sumsq(grads).to(self.device)  # the whole gradient; rank 0's
        if self.stage.sharded or n:
            self.comm.all_reduce(vec)
        if is_fake(vec):  # a rehearsal (zero_offload.rehearsal) has no values to read: every
            # parameter had a gradient, none arrived late, and the norm reads 0
            had = len(self._ranges)
            return [1.0] * had + [0.0] * (n - had) + [0.0]
        return vec.tolist()
