"""This rank's slice of the fp32 master parameters, its AdamW state, and the update.

All units' shards sit end to end in one rank-flat buffer, so the update is one call over a long
contiguous array — the shape a vectorized Adam wants — and a torch ``Optimizer`` over it gives
users ``param_groups`` for lr schedulers. Where that state lives (device, host, NVMe) is the
updater's business (``update.updaters``); this class prepares the gradients (unscale, overflow
check, global-norm clipping) and hands the new values to its ``sink``
(``update.sink``), which writes them back to the compute-dtype parameters: into the
rank's shard (stage 3) or all-gathered into the full flat buffers (stages 0–2 and persistent
stage-3 units).

Like ``torch.optim.AdamW``, a parameter that had no gradient in the accumulation window (on any
rank) is not stepped: no moment update, no weight decay, and its own step count (Adam's bias
correction) does not advance. The updater gets the rank-flat ranges to step, each with its
step count; in the common case (every parameter had a gradient every time) that is one range.
Parameters named in ``no_decay`` (biases, norm weights) are stepped with weight decay 0, as in
the no-decay parameter group of Hugging Face Trainer's AdamW: their ranges say so.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Generator, Iterator, Mapping

import torch
from torch._subclasses.fake_tensor import is_fake

from ..comm import Comm
from ..config import ConfigError, ZeroConfig
from ..device.streams import Streams
from ..grads.reducer import trainable_slots
from ..grads.slices import sum_of_squares
from ..memory.ledger import MemoryReport
from ..params.store import ParamStore
from ..params.units import FlatUnit
from ..weak import weak_hook
from .api import StepRange
from .loss_scale import LossScaler
from .overlap import DeferredUpdate
from .sink import ParamSink
from .updater import Updater
from .window import UpdateWindow, WindowCoordinator

__all__ = ["ShardStepper"]

log = logging.getLogger(__name__)


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


def _closable(steps: Iterator[int]) -> Generator[int, None, None]:
    """``steps`` as a generator: closing it closes theirs, if they are one."""
    yield from steps


class ShardStepper:
    def __init__(
        self,
        units: list[FlatUnit],
        cfg: ZeroConfig,
        comm: Comm,
        grads: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
        updater: Updater,
        params: ParamStore | None,
        streams: Streams,
        coordinator: WindowCoordinator,
    ) -> None:
        """``coordinator``: the engine's phase and update window, where the pass during backward
        and the update left under the forward are held (``update.window``)."""
        self.units = units
        self.coordinator = coordinator
        self.cfg = cfg
        self.comm = comm
        self.stage = cfg.sharding
        self.grads = grads  # None: the gradients are in files (NVMe optimizer, small budget)
        self.device = device  # scalars for collectives live here (NCCL needs device tensors)
        self.dtype = dtype
        self.updater = updater
        self.optimizer = updater.optimizer
        self.params = params
        self.streams = streams
        # the units the updater steps, in rank-flat order (frozen ones come after them)
        self._stepped = sorted((u for u in units if not u.frozen), key=lambda u: u.shard_offset)
        # where the new values go (a unit cut by NVMe sub-groups is assembled there)
        self.sink = ParamSink(
            self._stepped,
            self.stage,
            dtype,
            comm,
            streams,
            params,
            staging=cfg.offload.optimizer_tier.on_nvme,
        )
        p = cfg.precision
        self.scaler: LossScaler | None = None
        if p.dtype == torch.float16:
            self.scaler = LossScaler(
                p.initial_loss_scale,
                p.loss_scale_window,
                p.min_loss_scale,
                hysteresis=p.loss_scale_hysteresis,
                consecutive=p.consecutive_hysteresis,
            )
        elif p.skip_nonfinite_steps:
            self.scaler = LossScaler.guard()
        self._grad_norm: float | None = None
        self._host_vec: torch.Tensor | None = None  # what the step's exchange sends
        # per trainable parameter (grads.trainable_slots order): its name, this rank's
        # rank-flat elements of it, and the updates it missed (no gradient on any rank)
        slots = trainable_slots(units)
        self._names = [u.names[i] for u, i in slots]
        self._ranges = [self._rank_flat_range(u, i) for u, i in slots]
        self._skipped = [0] * len(slots)
        self._counts_before: tuple[list[int], dict | None] = (list(self._skipped), None)
        self._decays = _decays(units, slots, cfg.optimizer.no_decay)
        # the update can run under the next forward (overlap_step): it is stepped
        # sub-group by sub-group, and storing a unit needs no collective
        self._can_defer = (
            cfg.overlap_step
            and params is not None
            and updater.runs_under_forward
            and all(u.sharded_params for u in self._stepped)
        )
        # the final backward's pass over sub-groups whose gradients are complete, until the
        # step adopts or drops it (``update.nvme.early``): NVMe state, gradients in host
        # memory, reduced during backward (stages 2-3), and a factor known before the norm
        self._can_step_early = (
            cfg.step_during_backward
            and self.stage.reduces_during_backward
            and grads is not None
            and cfg.optimizer.max_grad_norm is None
            and self.scaler is None
        )
        self._position = {u.index: k for k, u in enumerate(self._stepped)}
        if params is not None:
            params.before_read = weak_hook(self.settle_through)

    def _rank_flat_range(self, unit: FlatUnit, i: int) -> tuple[int, int]:
        """This rank's rank-flat [lo, hi) of parameter ``i`` of ``unit`` (the padding after
        a parameter goes with it, so that neighbours stay contiguous); empty if none."""
        slots = unit.layout.slots
        start = 0 if i == 0 else slots[i].offset
        end = slots[i + 1].offset if i + 1 < len(slots) else unit.layout.padded_numel
        lo, hi = unit.layout.shard_range(0 if unit.layout.num_shards == 1 else self.comm.rank)
        a, b = max(start, lo), min(end, hi)
        return (unit.shard_offset + a - lo, unit.shard_offset + b - lo) if a < b else (0, 0)

    def _update_ranges(self, had_grad: list[bool] | None) -> list[StepRange] | None:
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
                self._skipped[k] += 1
                continue
            s, decays = step - self._skipped[k], self._decays[k]
            if lo == hi:
                continue
            if ranges and ranges[-1][1] == lo and ranges[-1][2:] == (s, decays):
                ranges[-1] = (ranges[-1][0], hi, s, decays)
            else:
                ranges.append((lo, hi, s, decays))
        return ranges

    # -- stepping during backward ---------------------------------------------------------
    def begin_backward(self, final: bool) -> None:
        """A backward starts: a pass of an earlier one is dropped; the final one of a window
        starts a new pass where it can run."""
        self.coordinator.drop_early()
        if final and self._can_step_early:
            early = self.updater.start_early(
                # every parameter with a gradient, each at its own step count: what the
                # step computes when that is so (it compares)
                self.grads,
                1.0,
                self._update_ranges([True] * len(self._ranges)),
                self.sink.starts,
            )
            if early is not None:
                self.coordinator.start_early(early)

    def landing(self) -> Callable[[FlatUnit], None] | None:
        """What the reducer calls once a unit's reduced gradients are in the host shard (a
        worker thread may): bound to this backward's pass, so that a late call from an
        earlier backward cannot reach it. None: no pass runs."""
        early, position = self.coordinator.early, self._position
        if early is None:
            return None

        def landed(unit: FlatUnit) -> None:
            if not unit.frozen:
                early.landed(position[unit.index])

        return landed

    def missed_updates(self) -> dict[str, int]:
        """Parameter name -> updates it was not stepped in (no gradient); nonzero ones only.
        Its own Adam step count is ``updater.steps`` minus this."""
        return {n: k for n, k in zip(self._names, self._skipped) if k}

    def load_missed_updates(self, by_name: Mapping[str, int]) -> None:
        self._skipped = [int(by_name.get(n, 0)) for n in self._names]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def _local_sumsq(self) -> torch.Tensor:
        """This rank's sum of squares of its reduced gradient shard, in fp64 on every device
        (so that the per-sub-group sums of gradients in files and the sum over a resident
        shard agree far below the fp32 clip factor's last bit), without a copy of the shard
        and without a wait; infinite or NaN when a gradient is (the overflow check)."""
        if self.updater.disk_grads is not None:
            sumsq, finite = self.updater.disk_grads.stats()
            return torch.tensor(sumsq if finite else math.inf, dtype=torch.float64)
        assert self.grads is not None  # not in files: in memory
        return sum_of_squares(self.grads)

    def _exchange(self, flags: torch.Tensor | None) -> list[float]:
        """One all-reduce (sum) and one host read per step: the ranks' gradient flags and,
        with clipping or float16, the sum of squares as the last element."""
        n = 0 if flags is None else flags.numel()
        if self._host_vec is None or self._host_vec.numel() != n + 1:
            # page-locked with CUDA: its copy to the device waits for no kernel
            self._host_vec = self.streams.host_empty(n + 1, torch.float64)
        self._host_vec.zero_()
        if flags is not None:
            self._host_vec[:n].copy_(flags)
        vec = self._host_vec.to(self.device, non_blocking=True)
        stats = self.scaler is not None or self.cfg.optimizer.max_grad_norm is not None
        if stats and (self.stage.sharded or self.comm.rank == 0):  # stage 0: every rank holds
            vec[n] = self._local_sumsq().to(self.device)  # the whole gradient; rank 0's
        if self.stage.sharded or n:
            self.comm.all_reduce(vec)
        if is_fake(vec):  # a rehearsal (zero_offload.rehearsal) has no values to read: every
            # parameter had a gradient, none arrived late, and the norm reads 0
            had = len(self._ranges)
            return [1.0] * had + [0.0] * (n - had) + [0.0]
        return vec.tolist()

    def step(
        self,
        flags: torch.Tensor | None = None,
        reduce_late: Callable[[list[bool]], None] | None = None,
        defer: Callable[[], None] | None = None,
    ) -> bool:
        """Agree on the gradient flags, check overflow, clip, update, write the params back.
        False: nothing applied (no parameter had a gradient on any rank, or an overflow).
        ``flags``: this rank's :meth:`GradReducer.local_flags` (None: every parameter had a
        gradient); ``reduce_late`` reduces the units whose late pieces some rank holds.
        ``defer``: where the update can run under the next forward (``overlap_step``), it is
        left in :attr:`pending` and ``defer`` is called once it ends.

        Unscaling and clipping fold into one factor that the updater applies as it reads the
        gradients: no pass over them here, and no fp32 copy of a low-precision shard."""
        try:
            return self._step(flags, reduce_late, defer)
        finally:
            self.coordinator.drop_early()  # a pass that no update adopted

    def _step(
        self,
        flags: torch.Tensor | None,
        reduce_late: Callable[[list[bool]], None] | None,
        defer: Callable[[], None] | None,
    ) -> bool:
        self.streams.sync_h2d()  # host shards some copy still reads may be overwritten now
        # what a failed update puts back, so that a retry counts this step once
        self._counts_before = (
            list(self._skipped),
            None if self.scaler is None else self.scaler.state_dict(),
        )
        values = self._exchange(flags)
        sumsq = values[-1]
        had: list[bool] | None = None
        if flags is not None:
            p = len(self._names)
            had = [v > 0 for v in values[:p]]
            late = [v > 0 for v in values[p:-1]]
            if any(late):
                assert reduce_late is not None
                # a pass during backward read sums that change now, and must not drive the
                # swapper beside the update
                self.coordinator.drop_early()
                reduce_late(late)  # rare (reentrant backward): the sums change, read again
                sumsq = self._exchange(None)[-1]
            if not any(had):
                log.info("step: no parameter had a gradient since the last update; nothing applied")
                self.optimizer.step()  # no .grad anywhere: a no-op that lr schedulers expect
                return False
        scale = self.loss_scale
        if self.scaler is not None:
            overflow = not math.isfinite(sumsq)
            self.scaler.update(overflow)
            if overflow:
                return False
        factor = 1.0 / scale
        max_norm = self.cfg.optimizer.max_grad_norm
        if max_norm is not None:
            norm = math.sqrt(sumsq) / scale
            self._grad_norm = norm
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                factor *= coef
        copied = self.sink.copied_bytes
        ranges = self._update_ranges(had)
        deferred = defer is not None and self._can_defer
        # the pass of this window's backward: adopted or dropped by the updater
        early = self.coordinator.begin_update(
            UpdateWindow.UNDER_FORWARD if deferred else UpdateWindow.AT_STEP
        )
        extra = {} if early is None else {"early": early}
        if deferred:
            assert defer is not None
            try:
                steps = self.updater.update_in_steps(
                    self.grads, factor, self.sink.sink, ranges, self.sink.targets, **extra
                )
            except BaseException:
                self.coordinator.end_update()
                raise
            self.coordinator.defer(
                DeferredUpdate(
                    _closable(steps), lambda: self._update_done(copied, defer), self._update_failed
                )
            )
            return True
        try:
            self.updater.update(
                self.grads, factor, self.sink.sink, ranges, self.sink.targets, **extra
            )
        except BaseException:
            self._update_failed()
            raise
        finally:
            self.coordinator.end_update()
        self._update_done(copied)
        return True

    def _update_done(self, copied: int, then: Callable[[], None] | None = None) -> None:
        self.updater.last_timings.param_copy_bytes = self.sink.copied_bytes - copied
        if then is not None:
            then()

    def _update_failed(self) -> None:
        """Give back what a failed update held for the values it did not store, and put
        back the counts the step moved (missed updates, the loss scaler): the state is as
        before, or unusable until loaded again (which sets them)."""
        skipped, scaler = self._counts_before
        self._skipped = skipped
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)
        self.sink.forget()

    def settle_through(self, unit: FlatUnit) -> None:
        """Before a unit's shard is read: step the pending update's sub-groups until the
        unit's new values are stored (frozen units have none)."""
        pending = self.coordinator.pending
        if pending is None or unit.frozen:
            return
        try:
            pending.run_through(unit.shard_offset + unit.shard_numel)
            # a unit written in part holds its target, a pool buffer, until its put; with no
            # other buffer left the read that follows would wait for it: run on (a sub-group
            # that ends the unit may start the next, so until none is held)
            while self.params is not None and self.params.lent_out and not pending.done:
                ends = self.sink.targeted_ends()
                if not ends:
                    break
                pending.run_through(max(ends))
        finally:
            self.coordinator.pending_ran()

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (with clipping on)."""
        return self._grad_norm

    def add_to(self, report: MemoryReport) -> None:
        self.updater.add_to(report)
        self.sink.add_to(report)
