"""``offload_optimizer="nvme"``: the optimizer state in files, stepped as a pipeline.

The rank-flat state is cut into sub-groups (sized to the shard and the host budget by
:mod:`.sizing`, at most ``sub_group_size`` parameters); sub-group k's [master | m | v]
is one file. A step reads group k+1 while the CPU Adam updates group k in its host buffer
and group k−1 is written back, so the disk and the CPU work at the same time.

``offload_optimizer_fraction`` keeps the leading sub-groups' state in host memory instead
(:func:`.sizing.optimizer_split`). A step starts reading the first sub-group in files,
then steps the host ones while that read is in flight: the host part hides the disk's latency
rather than adding a phase. Every sub-group runs the same kernel on the same elements, so
where a sub-group lives changes no bit.

A step is all-or-nothing from the caller's view. The step counter moves only once every
sub-group is written back. A step that fails before any sub-group changed leaves the state
as it was (a retry runs the same update). One that fails after that has changed some
sub-groups and not others: their files are dropped, and every later step or state read raises
:class:`IncompleteStepError` until the whole state is loaded again (``load_checkpoint`` or
``optimizer.load_state_dict``).

The fp32 gradient shard stays in host memory when it fits the host budget beside the
pipeline buffers. When it does not, gradients go to files too
(:class:`~zero_offload.grads.disk.DiskGrads`, the same sub-groups), and the step reads each
sub-group's back beside its state.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from ...config import ZeroConfig
from ...device.threads import ThreadBudget
from ...errors import BufferBudgetError, IncompleteStepError
from ...grads.disk import DiskGrads
from ...memory.ledger import MemoryReport
from ...optim import CPUAdam
from ...partition import chunks, split_range
from ...swap.budget import host_memory_budget
from ...swap.buffers import HostBuffer
from ...swap.pinned import host_empty, pinned_nbytes, pins, unpin
from ...swap.swapper import Swapper
from ..api import (
    Sink,
    StateChunk,
    StepRange,
    StepTimings,
    Targets,
    adam_hyperparameters,
    adam_kwargs,
    whole_range,
)
from ..updater import Updater
from .early import EarlyUpdate, next_key, out_key
from .group_step import GroupStep
from .io_clock import IoClock
from .sizing import PIPELINE_BUFFERS, OptimizerSplit, optimizer_split

__all__ = ["IncompleteStepError", "NvmeAdam"]

log = logging.getLogger(__name__)


class NvmeAdam(Updater):
    """Master, m and v in files, one per sub-group, stepped as a read/compute/write pipeline."""

    BUFFERS = PIPELINE_BUFFERS
    runs_under_forward = True
    swapper: Swapper
    split: OptimizerSplit

    def __init__(
        self,
        numel: int,
        cfg: ZeroConfig,
        dtype: torch.dtype,
        rank: int,
        host_memory_limit: int | None,
        threads: ThreadBudget | None = None,
    ) -> None:
        off = cfg.offload
        self.numel = numel
        # the kernel's threads: in the step, and in the pass during backward (update.nvme.early)
        self.threads = threads or ThreadBudget.decide("cpu", cfg.threads)
        budget = host_memory_budget(host_memory_limit)
        dtype_bytes = torch.empty(0, dtype=dtype).element_size()
        self.split = optimizer_split(
            numel, off.sub_group_size, budget, dtype_bytes, off.optimizer_fraction
        )
        self.sizing = self.split.sizing
        self.group = self.sizing.group
        self.bounds = chunks(numel, self.group)
        # the leading sub-groups whose [master | m | v] stay in host memory, back to back
        self.host_groups = -(-self.split.host_numel // self.group)
        self.host_state = torch.zeros(3 * self.split.host_numel, dtype=torch.float32)
        need = self.sizing.host_bytes(numel, dtype_bytes)
        if need > budget:
            raise BufferBudgetError(budget, need, 1)
        count = self.sizing.buffers
        on_disk = self.sizing.grads_on_disk
        state_budget = budget - self.sizing.out_bytes(dtype_bytes) - self.sizing.grad_bytes(numel)
        self.swapper = Swapper(
            off.nvme_dir,
            buffer_bytes=12 * self.group,
            buffer_count=count,
            min_buffers=2,
            host_memory_limit=state_budget,
            expected_bytes=12 * self.split.nvme_numel + 4 * on_disk * numel,
            rank=rank,
            # the master crosses PCIe only as fp32 compute's new params
            pin=pins(crosses_pcie=dtype == torch.float32),
            io_threads=self.threads.io,
        )
        # the gradient shard in files (None: the engine keeps it in host memory)
        self.disk_grads = (
            DiskGrads(
                off.nvme_dir,
                numel,
                self.group,
                count,
                rank,
                engine=self.swapper.engine,
                narrow=dtype if dtype.itemsize == 2 else None,
            )
            if on_disk
            else None
        )
        # The optimizer holds no tensors of its own: its param_groups carry the
        # hyperparameters (for lr schedulers); the state is in the swap files.
        self.placeholder = nn.Parameter(torch.empty(0), requires_grad=False)
        self.optimizer = CPUAdam(
            [self.placeholder], adamw=True, num_threads=self.threads.optimizer, **adam_kwargs(cfg)
        )
        # steps a sub-group in host memory; its buffer holds one sub-group's new params
        # (none in fp32: the master is what is written)
        self.group_step = GroupStep(
            host_empty(
                self.group if dtype != torch.float32 else 0,
                dtype,
                crosses_pcie=dtype != torch.float32,
            )
        )
        # bytes a parameter of the new values an early pass stores (fp32: the master)
        self.out_itemsize = torch.empty(0, dtype=dtype).element_size()
        self.steps = 0
        self.last_timings = StepTimings()
        # sub-groups whose files a failed step left undefined (dropped); empty when sound
        self._stale: set[int] = set()
        self._stale_cause = ""
        self._loading: tuple[int, HostBuffer] | None = None
        # sub-groups of the running update stepped during backward (:mod:`.early`),
        # and the pass of this window's backward while it runs
        self._replay: set[int] = set()
        self.early: EarlyUpdate | None = None
        self.io_clock = IoClock()
        log.info(
            "NVMe optimizer state: %d sub-groups of %d params (%d in host memory), %d host "
            "buffers of %.1f MiB%s",
            len(self.bounds),
            self.group,
            self.host_groups,
            self.swapper.pool.count,
            12 * self.group / 2**20,
            "; gradients on NVMe too" if on_disk else "",
        )

    @staticmethod
    def state_key(i: int) -> str:
        return f"adam.{i}"

    def _host(self, i: int) -> torch.Tensor | None:
        """Sub-group i's [master | m | v] as a (3, n) view when it lives in host memory."""
        if i >= self.host_groups:
            return None
        lo, hi = self.bounds[i]
        return self.host_state[3 * lo : 3 * hi].view(3, hi - lo)

    # -- state in -------------------------------------------------------------------------
    def load_state(
        self,
        offset: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor | None = None,
        exp_avg_sq: torch.Tensor | None = None,
    ) -> None:
        """Store state given in increasing, gap-free ``offset`` order (moments default to
        zeros); each sub-group is written as [master | m | v] once it is complete."""
        self._drop_early()
        values = (master, exp_avg, exp_avg_sq)
        for i, a, b in split_range(offset, offset + master.numel(), self.group):
            lo, hi = self.bounds[i]
            resident = self._host(i)
            if resident is not None:  # in host memory: copied in place, moments default to 0
                for row, src in enumerate(values):
                    part = resident[row, a - lo : b - lo]
                    if src is None:
                        part.zero_()
                    else:
                        part.copy_(src[a - offset : b - offset])
                if b == hi:
                    self._stale.discard(i)
                continue
            if self._loading is None:
                buf = self.swapper.pool.acquire(timeout=self.swapper.acquire_timeout)
                buf.view(torch.float32, (3, hi - lo))[1:].zero_()
                self._loading = (i, buf)
            buf = self._loading[1]
            state = buf.view(torch.float32, (3, hi - lo))
            for row, src in enumerate(values):
                if src is not None:
                    state[row, a - lo : b - lo].copy_(src[a - offset : b - offset])
            if b == hi:
                try:
                    self.swapper.swap_out(self.state_key(i), state.reshape(-1)).result()
                finally:
                    self.swapper.pool.release(buf)
                    self._loading = None
                self._stale.discard(i)

    # -- the step -------------------------------------------------------------------------
    def _read(self, i: int, timings: StepTimings) -> tuple[Future | None, Future | None]:
        """Start reading sub-group i's state (None when it is in host memory) and its
        gradients (None when they are in host memory)."""
        lo, hi = self.bounds[i]
        state = grad = None
        if i in self._replay:  # stepped during backward: only its new values are read
            timings.bytes_read += self.out_itemsize * (hi - lo)
            return self.io_clock.timed(self.swapper.prefetch(out_key(i)), "read_s", timings), None
        if i >= self.host_groups:
            timings.bytes_read += 12 * (hi - lo)
            state = self.io_clock.timed(self.swapper.prefetch(self.state_key(i)), "read_s", timings)
        if self.disk_grads is not None:
            timings.bytes_read += self.disk_grads.stored_bytes(i)
            grad = self.io_clock.timed(self.disk_grads.prefetch(i), "read_s", timings)
        return state, grad

    def _release(self, i: int) -> None:
        if i in self._replay:
            self.swapper.discard(out_key(i), at_once=False)  # read once
            return
        if i >= self.host_groups:
            self.swapper.release(self.state_key(i))
        if self.disk_grads is not None:
            self.disk_grads.release(i)

    def update(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        ranges: list[StepRange] | None = None,
        targets: Targets | None = None,
        early: EarlyUpdate | None = None,
    ) -> None:
        """``grads``: the host fp32 shard, or None when the gradients are in files.
        ``ranges``: what to step, with which step count (None: everything). ``targets``:
        where new compute-dtype values go (the kernel writes them there). ``early``: the
        pass of :meth:`start_early` in this window, adopted or dropped here. All or nothing:
        see the module's docstring."""
        for _ in self.update_in_steps(grads, factor, sink, ranges, targets, early):
            pass

    def update_in_steps(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        ranges: list[StepRange] | None = None,
        targets: Targets | None = None,
        early: EarlyUpdate | None = None,
    ) -> Iterator[int]:
        """:meth:`update`, one sub-group per iteration: each yields the rank-flat end of the
        elements whose new values went to ``sink`` so far, so that the caller can run other
        work (the next forward) while the disk reads and writes the next sub-groups. The
        soundness check and the hyperparameters are taken now: an lr scheduler stepped
        before the iteration ends changes the next update, not this one."""
        if early is not None and self._stale:
            early.drop()
        self._check_sound("step")
        step = self.steps + 1
        hyper = adam_hyperparameters(self.optimizer, step)
        ranges = whole_range(self.numel, step) if ranges is None else ranges
        done = [] if early is None else early.check(grads, hyper, ranges, factor)
        self.optimizer.step()  # no tensors to update; tells lr schedulers that a step ran
        return self._stepped_groups(grads, factor, sink, hyper, ranges, targets, done)

    def start_early(
        self,
        grads: torch.Tensor | None,
        factor: float,
        ranges: list[StepRange] | None,
        unit_starts: list[int],
    ) -> EarlyUpdate | None:
        """Start stepping the sub-groups in files during the final backward, as their
        gradients land in ``grads`` (:mod:`.early`); None where it cannot run: the
        gradients are in files, or no sub-group is, or the state is unsound."""
        if grads is None or self.disk_grads is not None or self._stale or is_fake(grads):
            return None  # (a rehearsal's fake gradients have no values to step)
        if self.host_groups >= len(self.bounds):
            return None
        step = self.steps + 1
        self.early = EarlyUpdate(
            self,
            grads,
            factor,
            adam_hyperparameters(self.optimizer, step),
            whole_range(self.numel, step) if ranges is None else ranges,
            unit_starts,
        )
        return self.early

    def early_ended(self, early: object) -> None:
        """The pass ``early`` stopped (:class:`~.groups.SubGroupFiles`)."""
        if self.early is early:
            self.early = None

    def _drop_early(self) -> None:
        """Reading or loading the state while a pass of :meth:`start_early` runs: the pass
        goes (it steps the buffers it reads in place; a load replaces its inputs)."""
        if self.early is not None:
            self.early.drop()

    def _stepped_groups(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        hyper: dict,
        ranges: list[StepRange],
        targets: Targets | None,
        early_done: list[int],
    ) -> Iterator[int]:
        changed: list[int] = []  # sub-groups whose state changed in memory
        try:
            self._replay = set(early_done)  # their new state takes over as they are replayed
            yield from self._pipeline(grads, factor, sink, hyper, changed, ranges, targets)
        except BaseException as exc:
            self._abort(exc, changed)
            raise
        finally:
            self._replay = set()
        self.steps += 1
        self.last_timings.early_groups = len(early_done)

    def ensure_sound(self, what: str) -> None:
        """Raise :class:`IncompleteStepError` when an earlier step left the state partly
        updated (the engine asks before anything that would read or build on it)."""
        self._check_sound(what)

    def _check_sound(self, what: str) -> None:
        if self._stale:
            raise IncompleteStepError(
                f"cannot {what}: an earlier optimizer step failed halfway ({self._stale_cause})"
                f" and left the NVMe optimizer state partly updated; restore a saved state "
                f"first with engine.load_checkpoint(...) (or engine.optimizer.load_state_dict)"
            )

    def _abort(self, exc: BaseException, changed: list[int]) -> None:
        """After a failed step: wait for the requests still in flight and give the buffers
        back. Nothing changed: the state is as before. Otherwise its files are dropped and
        the optimizer refuses to run until the state is loaded again."""
        if changed:
            self._stale = set(range(len(self.bounds)))
            self._stale_cause = (
                "the engine closed while it ran under the forward"
                if isinstance(exc, GeneratorExit)
                else f"{type(exc).__name__}: {exc}"
            )
        self.io_clock.wait_idle()
        for i in range(len(self.bounds)):
            try:
                if i in self._replay:  # the new state too, where it did not take over
                    self.swapper.discard(out_key(i))
                    self.swapper.discard(next_key(i))
                if i >= self.host_groups and changed:
                    self.swapper.discard(self.state_key(i))  # frees the disk too (ENOSPC)
                elif i >= self.host_groups:
                    self.swapper.release(self.state_key(i))
                if self.disk_grads is not None:
                    self.disk_grads.release(i)
            except OSError as err:  # the disk may be gone; the state is marked already
                log.warning("cleaning up after the failed step: %s", err)
        if not changed:
            log.warning(
                "optimizer step failed before any state changed (%s); the state is "
                "as before the step",
                exc,
            )
            return
        if isinstance(exc, GeneratorExit):  # no caller to raise to: the engine closes
            log.warning(
                "an optimizer update running under the forward was dropped after %d of %d "
                "sub-groups (the engine closed during an exception)",
                len(changed),
                len(self.bounds),
            )
            return
        if not isinstance(exc, Exception):  # Ctrl-C, an exit: it goes on as it is
            log.warning(
                "optimizer step interrupted (%s) after updating %d of %d NVMe sub-groups; "
                "the partly updated state must be loaded again",
                type(exc).__name__,
                len(changed),
                len(self.bounds),
            )
            return
        log.error(
            "optimizer step failed after updating %d of %d sub-groups (%s); the state "
            "must be loaded again",
            len(changed),
            len(self.bounds),
            self._stale_cause,
        )
        raise IncompleteStepError(
            f"the optimizer step failed after updating {len(changed)} of {len(self.bounds)} "
            f"NVMe sub-groups ({self._stale_cause}); the partly updated state was dropped. "
            "Restore a saved state with engine.load_checkpoint(...) (or "
            "engine.optimizer.load_state_dict) before stepping again"
        ) from exc

    def _pipeline(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        hyper: dict,
        changed: list[int],
        ranges: list[StepRange],
        targets: Targets | None = None,
    ) -> Iterator[int]:
        """Read, update and write back every sub-group, stepping ``ranges``; each sub-group
        whose state is about to change is appended to ``changed``, and its end is yielded
        once its new values went to ``sink``. Ends once all are on disk. Host-resident
        sub-groups come first and are stepped while the first read from disk is in flight."""
        timings = StepTimings()
        start = time.perf_counter()
        last = len(self.bounds) - 1
        if last < 0:  # nothing trains (every parameter frozen)
            self.last_timings = timings
            return
        lookahead = self.swapper.pool.count >= self.BUFFERS and (
            self.disk_grads is None or self.disk_grads.buffers >= self.BUFFERS
        )
        first_disk = self.host_groups  # reading it overlaps the host sub-groups' compute
        pending = self._read(first_disk, timings) if first_disk <= last else None
        writes: dict[int, Future] = {}  # sub-group -> its write-back

        def release(j: int) -> None:
            """Give sub-group j's buffers back once its write-back is done; a failed one
            fails the step now, before the pipeline runs short of buffers it keeps."""
            write = writes.get(j)
            if write is not None:
                write.result()
            self._release(j)

        for i, (lo, hi) in enumerate(self.bounds):
            resident = self._host(i)
            if resident is not None:
                grad_read = self._read(i, timings)[1] if self.disk_grads is not None else None
                if grad_read is not None:
                    grad = grad_read.result()
                else:
                    assert grads is not None  # not in files: the host shard was passed
                    grad = grads[lo:hi]
                changed.append(i)
                self.group_step.step(
                    resident, grad, lo, hi, factor, ranges, hyper, sink, timings, targets
                )
                self._release(i)
                yield hi
                continue
            assert pending is not None and pending[0] is not None
            if i in self._replay:  # stepped during backward: hand on its new values
                values = pending[0].result()
                if lookahead and i < last:
                    pending = self._read(i + 1, timings)
                self.swapper.take_over(self.state_key(i), next_key(i))  # raises: unchanged
                changed.append(i)  # from here on, its new state is the state
                self.group_step.replay(values, lo, hi, sink, timings, targets)
            else:
                assert pending[0] is not None  # in files: its state is read
                state = pending[0].result().view(3, hi - lo)
                if pending[1] is not None:  # read from the gradient files
                    grad = pending[1].result()
                else:
                    assert grads is not None  # not in files: the host shard was passed
                    grad = grads[lo:hi]
                if lookahead and i < last:
                    pending = self._read(i + 1, timings)
                changed.append(i)  # from here on, sub-group i (and its gradients) change
                self.group_step.step(
                    state, grad, lo, hi, factor, ranges, hyper, sink, timings, targets
                )
                timings.bytes_written += 12 * (hi - lo)
                writes[i] = self.io_clock.timed(
                    self.swapper.swap_out(self.state_key(i), state.reshape(-1)),
                    "write_s",
                    timings,
                )
            if i > first_disk:
                release(i - 1)
            if not lookahead and i < last:
                release(i)
                pending = self._read(i + 1, timings)
            yield hi
        if first_disk <= last:
            release(last)
        self.io_clock.wait_idle()  # completion callbacks may still be running
        for write in writes.values():
            write.result()  # a failed write-back fails the step
        timings.wall_s = time.perf_counter() - start
        self.last_timings = timings

    # -- state out ------------------------------------------------------------------------
    def iter_state(self) -> Iterator[StateChunk]:
        """Each sub-group read from its file (a pool buffer: used before the next is read)."""
        self._check_sound("read the optimizer state")
        self._drop_early()
        for i, (lo, hi) in enumerate(self.bounds):
            resident = self._host(i)
            if resident is not None:
                yield lo, hi, resident[0], resident[1], resident[2]
                continue
            state = self.swapper.swap_in(self.state_key(i)).result().view(3, hi - lo)
            try:
                yield lo, hi, state[0], state[1], state[2]
            finally:
                self.swapper.release(self.state_key(i))

    def master_values(self) -> torch.Tensor:
        """A host copy of the fp32 master, read sub-group by sub-group from the files."""
        master = torch.empty(self.numel, dtype=torch.float32)
        for lo, hi, values, _, _ in self.iter_state():
            master[lo:hi].copy_(values)
        return master

    def add_to(self, report: MemoryReport) -> None:
        out = self.group_step.out
        report.add("nvme", "optimizer", 12 * self.split.nvme_numel)
        report.add(
            "host",
            "optimizer",
            self.swapper.host_buffer_nbytes
            + out.numel() * out.element_size()
            + self.split.host_state_bytes,
            pinned=self.swapper.pool.pinned_nbytes + pinned_nbytes(out),
        )
        if self.disk_grads is not None:
            self.disk_grads.add_to(report)

    def close(self) -> None:
        unpin(self.group_step.out)
        if self.disk_grads is not None:
            self.disk_grads.close()
        self.swapper.close()
