"""``offload_optimizer="nvme"`` for every optimizer-state policy other than fp32 AdamW.

:class:`NvmeState` is :class:`~zero_offload.update.host_state.HostState` with the run's state
in files: the run is cut into sub-groups on the layout's block boundaries
(:meth:`StateLayout.floor_boundary`, so every sub-group owns whole 8-bit blocks), and sub-group
k's state (master, compensation, moments as values / absmax / side arrays, see
:mod:`zero_offload.optim.layout`) is one file of :func:`~zero_offload.optim.state.buffer_bytes`
of its span: the disk moves what the policy keeps, not 12 bytes a parameter. A step reads
sub-group k+1 while the kernel steps sub-group k where it was read
(:meth:`ShardState.from_buffer`, :func:`zero_offload.optim.step`, as HostState steps its
ranges) and sub-group k-1 is written back (:mod:`.pipeline`). Some sub-groups stay in host
memory, spread between the others (``offload_optimizer_fraction``, the one rule of
:mod:`.sizing`). Every sub-group runs the same kernel on the same elements as HostState, so
the tier changes no bit.

The concatenated sub-group arrays are the run's arrays, so :meth:`native_tensors` is what
HostState keeps and checkpoints move between the two. fp32 AdamW stays with
:class:`~.adam.NvmeAdam`. Not here yet: gradients in files (a budget that cannot hold the
fp32 gradient shard is refused) and stepping during backward (``step_during_backward``
steps at ``step()`` instead, the same bits).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Iterator, Mapping

import torch
import torch.nn as nn

from ...config import ZeroConfig
from ...device.threads import ThreadBudget
from ...errors import ConfigError
from ...memory.ledger import MemoryReport
from ...optim import CPUOptimizer, ShardState, StateLayout, StepHyper
from ...optim.policy import MasterPrecision
from ...optim.state import buffer_bytes
from ...swap.budget import host_memory_budget
from ...swap.buffers import HostBuffer
from ...swap.pinned import host_empty, pinned_nbytes, pins, unpin
from ...swap.swapper import Swapper
from ..api import Sink, StateChunk, StepRange, StepTimings, Targets, whole_range
from ..host_state import SECTION_OF, restore_native
from ..updater import Updater
from .group_step import StateGroupStep
from .pipeline import Reads, SubGroupPipeline
from .sizing import (
    PIPELINE_BUFFERS,
    OptimizerSplit,
    host_placement,
    optimizer_split,
    out_itemsize,
)

if TYPE_CHECKING:
    from .early import EarlyUpdate

__all__ = ["NvmeState", "group_bounds"]


def group_bounds(layout: StateLayout, group: int) -> list[tuple[int, int]]:
    """Sub-groups of about ``group`` elements, each cut on a block boundary."""
    bounds, lo, n = [], 0, layout.numel
    while lo < n:
        hi = n if lo + group >= n else layout.floor_boundary(lo + group)
        hi = hi if hi > lo else min(n, lo + group)  # a segment shorter than a block
        bounds.append((lo, hi))
        lo = hi
    return bounds


class NvmeState(Updater):
    """Any non-default policy's state in files, one per sub-group, stepped as a pipeline."""

    runs_under_forward = True
    swapper: Swapper
    split: OptimizerSplit
    optimizer: CPUOptimizer

    def __init__(
        self,
        layout: StateLayout,
        cfg: ZeroConfig,
        dtype: torch.dtype,
        rank: int,
        host_memory_limit: int | None,
        threads: ThreadBudget | None = None,
    ) -> None:
        off, o = cfg.offload, cfg.optimizer
        self.layout, self.policy, self.dtype = layout, layout.policy, dtype
        self.numel = n = layout.numel
        self.threads = threads or ThreadBudget.decide("cpu", cfg.threads)
        budget = host_memory_budget(host_memory_limit)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        fp32_master = self.policy.master is MasterPrecision.FP32
        # sized as fp32 AdamW's pipeline (what this policy holds is no larger), with the
        # compute-dtype output of a sub-group unless an fp32 master is the fp32 parameters
        out_item = out_itemsize(fp32_master, itemsize)
        split = optimizer_split(n, off.sub_group_size, budget, out_item, off.optimizer_fraction)
        if split.sizing.grads_on_disk:
            raise ConfigError(
                f"{self.policy.describe()} on NVMe keeps the fp32 gradient shard "
                f"({4 * n / 2**30:.2f} GiB) in host memory beside the pipeline, which "
                f"host_memory_limit={budget} bytes cannot hold; raise host_memory_limit, "
                'use offload_optimizer="nvme" with the fp32 AdamW defaults (gradients in '
                "files), or a smaller model shard (more ranks)"
            )
        self.split = split
        self.bounds = group_bounds(layout, split.sizing.group)
        self.spans = [layout.span(lo, hi) for lo, hi in self.bounds]
        # as many sub-groups in host memory as cover the split's host share, spread
        host = sum(1 for lo, _ in self.bounds if lo < split.host_numel)
        self.on_host = host_placement(len(self.bounds), host)
        self.resident = {
            i: ShardState.zeros(s) for i, s in enumerate(self.spans) if self.on_host[i]
        }
        on_disk = [s for i, s in enumerate(self.spans) if not self.on_host[i]]
        self.file_bytes = max((buffer_bytes(s) for s in on_disk), default=0)
        self.swapper = Swapper(
            off.nvme_dir,
            buffer_bytes=max(self.file_bytes, 1),
            buffer_count=split.sizing.buffers,
            min_buffers=2,
            host_memory_limit=budget - 4 * n,
            expected_bytes=sum(buffer_bytes(s) for s in on_disk),
            rank=rank,
            pin=pins(crosses_pcie=dtype == torch.float32),
            io_threads=self.threads.io,
        )
        self.placeholder = nn.Parameter(torch.empty(0), requires_grad=False)
        self.optimizer = CPUOptimizer(
            [self.placeholder],
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            optimizer_type=self.policy.kind.value,
            moment_precision=self.policy.moments.value,
            master_precision=self.policy.master.value,
            num_threads=self.threads.optimizer,
        )
        # new compute-dtype values of one sub-group, unless the fp32 master is them
        needs_out = out_item > 0
        widest = max((hi - lo for lo, hi in self.bounds), default=0)
        self.group_step = StateGroupStep(
            layout, host_empty(widest if needs_out else 0, dtype, crosses_pcie=True)
        )
        self.steps = 0
        self.last_timings = StepTimings()
        self.pipeline = SubGroupPipeline(self.bounds, self.on_host)
        self._loading: tuple[int, ShardState, HostBuffer] | None = None

    @staticmethod
    def state_key(i: int) -> str:
        return f"state.{i}"

    def group_state(self, i: int, data: torch.Tensor) -> ShardState:
        """Sub-group i's arrays as views of ``data``, the bytes of its file."""
        return ShardState.from_buffer(self.spans[i], data.view(torch.uint8).reshape(-1))

    # -- state in -------------------------------------------------------------------------
    def load_state(
        self,
        offset: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor | None = None,
        exp_avg_sq: torch.Tensor | None = None,
    ) -> None:
        """fp32 values of run elements [offset, offset + n) given in increasing, gap-free
        order (moments default to zeros); a sub-group's file is written once complete."""
        end = offset + master.numel()
        sections = (master, exp_avg, exp_avg_sq)
        for i, (lo, hi) in enumerate(self.bounds):
            a, b = max(lo, offset), min(hi, end)
            if a >= b:
                continue
            if self.on_host[i]:
                state = self.resident[i]
            else:
                if self._loading is None or self._loading[0] != i:
                    self._start_loading(i)
                assert self._loading is not None
                state = self._loading[1]
            values = {"master": master[a - offset : b - offset]}
            for name in self.policy.moment_names:
                src = sections[SECTION_OF[name]]
                if src is not None:
                    values[name] = src[a - offset : b - offset]
            state.narrow(self.layout.span(a, b)).load_fp32(values)
            if b == hi and not self.on_host[i]:
                self._write_loaded(i)
            if b == hi:
                self.pipeline.loaded(i)

    def _start_loading(self, i: int) -> None:
        """A zeroed pool buffer for sub-group i's file (zeros: moments 0, absmax 0)."""
        buf = self.swapper.pool.acquire(timeout=self.swapper.acquire_timeout)
        data = buf.view(torch.uint8, (buffer_bytes(self.spans[i]),))
        data.zero_()
        self._loading = (i, self.group_state(i, data), buf)

    def _write_loaded(self, i: int) -> None:
        assert self._loading is not None
        _, state, buf = self._loading
        try:
            data = buf.view(torch.uint8, (buffer_bytes(self.spans[i]),))
            self.swapper.swap_out(self.state_key(i), data).result()
        finally:
            self.swapper.pool.release(buf)
            self._loading = None

    # -- the step -------------------------------------------------------------------------
    def update(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        ranges: list[StepRange] | None = None,
        targets: Targets | None = None,
    ) -> None:
        for _ in self.update_in_steps(grads, factor, sink, ranges, targets):
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
        """:meth:`update` one sub-group per iteration, yielding the end of the elements
        handed to ``sink`` so far (``overlap_step`` runs the next forward between them).
        The hyperparameters are taken now. All or nothing: see :mod:`.pipeline`."""
        assert early is None, "no pass during backward: start_early gave none"
        self.ensure_sound("step")
        assert grads is not None
        step = self.steps + 1
        hyper = StepHyper.from_group(self.optimizer.param_groups[0], step, factor)
        ranges = whole_range(self.numel, step) if ranges is None else ranges
        self.optimizer.step()  # no .grad: changes nothing; tells lr schedulers a step ran
        return self._stepped(_StateStep(self, grads, sink, hyper, ranges))

    def _stepped(self, run: _StateStep) -> Iterator[int]:
        lookahead = self.swapper.pool.count >= PIPELINE_BUFFERS
        self.last_timings = yield from self.pipeline.run(run, lookahead)
        self.steps += 1

    def ensure_sound(self, what: str) -> None:
        self.pipeline.ensure_sound(what)

    # -- state out ------------------------------------------------------------------------
    def _groups(self, lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, ShardState]]:
        """Each sub-group's state that meets run elements [lo, hi), read from its file
        (used before the next is read)."""
        self.ensure_sound("read the optimizer state")
        hi = self.numel if hi is None else hi
        for i, (a, b) in enumerate(self.bounds):
            if b <= lo or a >= hi:
                continue
            if self.on_host[i]:
                yield i, self.resident[i]
                continue
            buf = self.swapper.swap_in(self.state_key(i)).result()
            try:
                yield i, self.group_state(i, buf)
            finally:
                self.swapper.release(self.state_key(i))

    def iter_state(self) -> Iterator[StateChunk]:
        """(lo, hi, master, exp_avg, exp_avg_sq) fp32, a sub-group at a time."""
        for i, state in self._groups():
            lo, hi = self.bounds[i]
            values = state.to_fp32()
            sections = [values["master"]] + [torch.zeros(hi - lo) for _ in range(2)]
            for name in self.policy.moment_names:
                sections[SECTION_OF[name]] = values[name]
            yield lo, hi, sections[0], sections[1], sections[2]

    def native_tensors(self) -> dict[str, torch.Tensor]:
        """The run's arrays as stored (what :meth:`HostState.native_tensors` gives)."""
        whole = ShardState.zeros(self.layout.span())
        for i, state in self._groups():
            target = dict(whole.narrow(self.spans[i]).tensors())
            for name, t in state.tensors():
                target[name].copy_(t)
        return dict(whole.tensors())

    def load_native(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`native_tensors` saved by a run of the same policy and layout."""
        whole = ShardState.zeros(self.layout.span())
        restore_native(dict(whole.tensors()), tensors, self.policy)
        for i, span in enumerate(self.spans):
            part = dict(whole.narrow(span).tensors())
            if self.on_host[i]:
                for name, t in self.resident[i].tensors():
                    t.copy_(part[name])
                continue
            self._start_loading(i)
            assert self._loading is not None
            for name, t in self._loading[1].tensors():
                t.copy_(part[name])
            self._write_loaded(i)
        for i in range(len(self.bounds)):
            self.pipeline.loaded(i)

    def param_values(self, lo: int, hi: int) -> torch.Tensor:
        """The compute-dtype values the kernel writes for run elements [lo, hi) (a unit's
        shard: on block boundaries), read from the sub-groups that hold them."""
        out = torch.empty(hi - lo, dtype=self.dtype)
        for i, state in self._groups(lo, hi):
            a, b = max(lo, self.bounds[i][0]), min(hi, self.bounds[i][1])
            part = state.narrow(self.layout.span(a, b))
            same = part.master.dtype == self.dtype
            out[a - lo : b - lo].copy_(part.master if same else part.master_fp32())
        return out

    def master_values(self) -> torch.Tensor:
        """A host copy of the fp32 master, read sub-group by sub-group."""
        master = torch.empty(self.numel, dtype=torch.float32)
        for i, state in self._groups():
            lo, hi = self.bounds[i]
            master[lo:hi].copy_(state.master_fp32())
        return master

    def add_to(self, report: MemoryReport) -> None:
        on_disk = sum(buffer_bytes(s) for i, s in enumerate(self.spans) if not self.on_host[i])
        held = sum(
            t.numel() * t.element_size() for s in self.resident.values() for _, t in s.tensors()
        )
        out = self.group_step.out
        report.add("nvme", "optimizer", on_disk)
        report.add(
            "host",
            "optimizer",
            self.swapper.host_buffer_nbytes + out.numel() * out.element_size() + held,
            pinned=self.swapper.pool.pinned_nbytes + pinned_nbytes(out),
        )

    def close(self) -> None:
        unpin(self.group_step.out)
        self.swapper.close()


class _StateStep:
    """One update's sub-groups as :class:`~.pipeline.SubGroupPipeline` steps them: a
    sub-group's file is read into a pool buffer, its arrays are stepped there
    (:func:`zero_offload.optim.step` over the ranges) and the buffer is written back."""

    def __init__(
        self,
        owner: NvmeState,
        grads: torch.Tensor,
        sink: Sink,
        hyper: StepHyper,
        ranges: list[StepRange],
    ) -> None:
        self.owner, self.grads, self.sink = owner, grads, sink
        self.hyper, self.ranges = hyper, ranges

    def read_group(self, i: int, timings: StepTimings) -> Reads:
        owner = self.owner
        if owner.on_host[i]:
            return ()
        timings.bytes_read += buffer_bytes(owner.spans[i])
        read = owner.swapper.prefetch(owner.state_key(i))
        return (owner.pipeline.io_clock.timed(read, "read_s", timings),)

    def step_group(self, i: int, got: list, timings: StepTimings) -> Future | None:
        owner = self.owner
        data = got[0] if got else None
        state = owner.resident[i] if data is None else owner.group_state(i, data)
        owner.pipeline.changing(i)
        owner.group_step.step(
            state,
            self.grads,
            self.hyper,
            self.ranges,
            self.sink,
            timings,
            owner.optimizer.num_threads,
        )
        if data is None:
            return None
        timings.bytes_written += buffer_bytes(owner.spans[i])
        write = owner.swapper.swap_out(owner.state_key(i), data)
        return owner.pipeline.io_clock.timed(write, "write_s", timings)

    def release_group(self, i: int) -> None:
        if not self.owner.on_host[i]:
            self.owner.swapper.release(self.owner.state_key(i))

    def drop_group(self, i: int, changed: bool) -> None:
        owner = self.owner
        if not owner.on_host[i] and changed:
            owner.swapper.discard(owner.state_key(i))  # frees the disk too (ENOSPC)
        elif not owner.on_host[i]:
            owner.swapper.release(owner.state_key(i))
