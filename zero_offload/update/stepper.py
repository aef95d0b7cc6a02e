"""This rank's slice of the fp32 master parameters, its AdamW state, and the update.

All units' shards sit end to end in one rank-flat buffer, so the update is one call over a long
contiguous array — the shape a vectorized Adam wants — and a torch ``Optimizer`` over it gives
users ``param_groups`` for lr schedulers. Where that state lives (device, host, NVMe) is the
updater's business (``update.updaters``); this class prepares the gradients (unscale, overflow
check, global-norm clipping) and hands the new values to its ``sink``
(``update.sink``), which writes them back to the compute-dtype parameters: into the
rank's shard (stage 3) or all-gathered into the full flat buffers (stages 0–2 and persistent
stage-3 units).

Which parameters step, at which counts and with which weight decay, and the global norm, are
agreed among the ranks first (``update.grad_prep``).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Generator, Iterator, Mapping

import torch

from ..comm import Comm
from ..config import ZeroConfig
from ..device.streams import Streams
from ..memory.ledger import MemoryReport
from ..params.store import ParamStore
from ..params.units import FlatUnit
from ..weak import weak_hook
from .grad_prep import GradPrep
from .loss_scale import LossScaler
from .sink import ParamSink
from .updater import Updater
from .window import DeferredUpdate, UpdateWindow, WindowCoordinator

__all__ = ["ShardStepper"]

log = logging.getLogger(__name__)


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
        self.stage = cfg.sharding
        self.grads = grads  # None: the gradients are in files (NVMe optimizer, small budget)
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
        # which parameters step and at which counts, agreed with the other ranks
        self.prep = GradPrep(units, cfg, comm, device, streams, updater)
        self._counts_before: tuple[list[int], dict | None] = (list(self.prep.skipped), None)
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

    # -- stepping during backward ---------------------------------------------------------
    def begin_backward(self, final: bool) -> None:
        """A backward starts: a pass of an earlier one is dropped; the final one of a window
        starts a new pass where it can run."""
        self.coordinator.drop_early()
        if final and self._can_step_early:
            early = self.updater.start_early(
                self.grads, 1.0, self.prep.all_ranges(), self.sink.starts
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
        """Parameter name -> updates it was not stepped in (``update.grad_prep``)."""
        return self.prep.missed_updates()

    def load_missed_updates(self, by_name: Mapping[str, int]) -> None:
        self.prep.load_missed_updates(by_name)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

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
            list(self.prep.skipped),
            None if self.scaler is None else self.scaler.state_dict(),
        )
        # with clipping or float16, the sum of squares comes with the flags
        stats = self.scaler is not None or self.cfg.optimizer.max_grad_norm is not None
        values = self.prep.exchange(flags, self.grads, stats)
        sumsq = values[-1]
        had: list[bool] | None = None
        if flags is not None:
            p = len(self.prep.names)
            had = [v > 0 for v in values[:p]]
            late = [v > 0 for v in values[p:-1]]
            if any(late):
                assert reduce_late is not None
                # a pass during backward read sums that change now, and must not drive the
                # swapper beside the update
                self.coordinator.drop_early()
                reduce_late(late)  # rare (reentrant backward): the sums change, read again
                sumsq = self.prep.exchange(None, self.grads, stats)[-1]
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
        ranges = self.prep.update_ranges(had)
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
        self.prep.skipped = skipped
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
