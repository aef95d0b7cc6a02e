"""``offload_optimizer="nvme"``: the optimizer state in files, stepped as a pipeline.

The rank-flat state is cut into sub-groups (sized to the shard and the host budget by
:mod:`.sizing`, at most ``sub_group_size`` parameters); sub-group k's [master | m | v]
is one file, stepped by :class:`~.adam_step.AdamStep` through the read / compute / write
pipeline of :mod:`.pipeline`, which also says what a failed step leaves.

``offload_optimizer_fraction`` keeps some sub-groups' state in host memory instead,
spread between those in files (:func:`.sizing.optimizer_split` and
:func:`.sizing.host_placement`). Every sub-group runs the same kernel on the same elements,
so where a sub-group lives changes no bit.

The fp32 gradient shard stays in host memory when it fits the host budget beside the
pipeline buffers. When it does not, gradients go to files too
(:class:`~zero_offload.grads.disk.DiskGrads`, the same sub-groups), and the step reads each
sub-group's back beside its state.
"""

from __future__ import annotations

import logging
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
from ...optim.policy import ADAM_STATE_BYTES
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
from .adam_step import AdamStep
from .early import EarlyUpdate
from .group_step import GroupStep
from .pipeline import SubGroupPipeline
from .sizing import (
    PIPELINE_BUFFERS,
    OptimizerSplit,
    host_placement,
    optimizer_split,
    out_itemsize,
)

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
        out_item = out_itemsize(True, torch.empty(0, dtype=dtype).element_size())
        self.split = optimizer_split(
            numel, off.sub_group_size, budget, out_item, off.optimizer_fraction
        )
        self.sizing = self.split.sizing
        self.group = self.sizing.group
        self.bounds = chunks(numel, self.group)
        # the sub-groups whose [master | m | v] stay in host memory, back to back in
        # host_state (all whole sub-groups: the short last one is in files unless all are here)
        self.on_host = host_placement(len(self.bounds), -(-self.split.host_numel // self.group))
        self._host_slot = {i: k for k, i in enumerate(i for i, h in enumerate(self.on_host) if h)}
        self.host_state = torch.zeros(3 * self.split.host_numel, dtype=torch.float32)
        need = self.sizing.host_bytes(numel, out_item)
        if need > budget:
            raise BufferBudgetError(budget, need, 1)
        count = self.sizing.buffers
        on_disk = self.sizing.grads_on_disk
        state_budget = budget - self.sizing.out_bytes(out_item) - self.sizing.grad_bytes(numel)
        self.swapper = Swapper(
            off.nvme_dir,
            buffer_bytes=ADAM_STATE_BYTES * self.group,
            buffer_count=count,
            min_buffers=2,
            host_memory_limit=state_budget,
            expected_bytes=ADAM_STATE_BYTES * self.split.nvme_numel + 4 * on_disk * numel,
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
        self.pipeline = SubGroupPipeline(self.bounds, self.on_host)
        self._loading: tuple[int, HostBuffer] | None = None
        self.early: EarlyUpdate | None = None  # the pass of this window's backward, running
        log.info(
            "NVMe optimizer state: %d sub-groups of %d params (%d in host memory), %d host "
            "buffers of %.1f MiB%s",
            len(self.bounds),
            self.group,
            len(self._host_slot),
            self.swapper.pool.count,
            ADAM_STATE_BYTES * self.group / 2**20,
            "; gradients on NVMe too" if on_disk else "",
        )

    @staticmethod
    def state_key(i: int) -> str:
        return f"adam.{i}"

    def host_view(self, i: int) -> torch.Tensor | None:
        """Sub-group i's [master | m | v] as a (3, n) view when it lives in host memory."""
        slot = self._host_slot.get(i)
        if slot is None:
            return None
        lo, hi = self.bounds[i]
        start = 3 * slot * self.group
        return self.host_state[start : start + 3 * (hi - lo)].view(3, hi - lo)

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
            resident = self.host_view(i)
            if resident is not None:  # in host memory: copied in place, moments default to 0
                for row, src in enumerate(values):
                    part = resident[row, a - lo : b - lo]
                    if src is None:
                        part.zero_()
                    else:
                        part.copy_(src[a - offset : b - offset])
                if b == hi:
                    self.pipeline.loaded(i)
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
                self.pipeline.loaded(i)

    # -- the step -------------------------------------------------------------------------
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
        see :mod:`.pipeline`."""
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
        if early is not None and not self.pipeline.sound:
            early.drop()
        self.pipeline.ensure_sound("step")
        step = self.steps + 1
        hyper = adam_hyperparameters(self.optimizer, step, self.threads.optimizer)
        ranges = whole_range(self.numel, step) if ranges is None else ranges
        done = [] if early is None else early.check(grads, hyper, ranges, factor)
        self.optimizer.step()  # no tensors to update; tells lr schedulers that a step ran
        return self._stepped_groups(
            AdamStep(self, grads, factor, sink, hyper, ranges, targets, set(done))
        )

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
        if grads is None or self.disk_grads is not None or is_fake(grads):
            return None  # (a rehearsal's fake gradients have no values to step)
        if not self.pipeline.sound or all(self.on_host):
            return None
        step = self.steps + 1
        self.early = EarlyUpdate(
            self,
            grads,
            factor,
            adam_hyperparameters(self.optimizer, step, self.threads.optimizer),
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

    def _stepped_groups(self, run: AdamStep) -> Iterator[int]:
        lookahead = self.swapper.pool.count >= self.BUFFERS and (
            self.disk_grads is None or self.disk_grads.buffers >= self.BUFFERS
        )
        self.last_timings = yield from self.pipeline.run(run, lookahead)
        self.steps += 1
        self.last_timings.early_groups = len(run.replay)

    def ensure_sound(self, what: str) -> None:
        """Raise :class:`IncompleteStepError` when an earlier step left the state partly
        updated (the engine asks before anything that would read or build on it)."""
        self.pipeline.ensure_sound(what)

    # -- state out ------------------------------------------------------------------------
    def iter_state(self) -> Iterator[StateChunk]:
        """Each sub-group read from its file (a pool buffer: used before the next is read)."""
        self.pipeline.ensure_sound("read the optimizer state")
        self._drop_early()
        for i, (lo, hi) in enumerate(self.bounds):
            resident = self.host_view(i)
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
        report.add("nvme", "optimizer", ADAM_STATE_BYTES * self.split.nvme_numel)
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
