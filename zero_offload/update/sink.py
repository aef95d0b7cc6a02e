"""Where an update's new parameter values go.

The updater produces new fp32 values range by range of the rank-flat shard; each unit they
complete is written into its compute-dtype parameters: a stage-3 shard into the parameter
store (host memory or the buffer it is written to disk from), stages 0-2 and persistent
stage-3 units into the full flat buffer (all-gathered from the ranks' shards). Where the store
can lend a shard's own memory, the updater writes the values straight there (:meth:`targets`)
and nothing is copied after. A unit cut by an NVMe sub-group boundary is assembled in a
staging buffer until its last piece arrives.
"""

from __future__ import annotations

import bisect

import torch

from ..comm import Comm
from ..device.streams import Streams
from ..memory.ledger import MemoryReport
from ..params.store import ParamStore
from ..params.units import FlatUnit
from ..policies import Stage
from ..swap.pinned import host_empty, pinned_nbytes, unpin

__all__ = ["ParamSink"]


class ParamSink:
    """Stores the new values of ``stepped`` (the trainable units in rank-flat order) as the
    updater hands them over. ``staging``: whether units can be cut by sub-groups (NVMe
    optimizer state), which sizes a buffer for the largest of them."""

    def __init__(
        self,
        stepped: list[FlatUnit],
        stage: Stage,
        dtype: torch.dtype,
        comm: Comm,
        streams: Streams,
        params: ParamStore | None,
        staging: bool,
    ) -> None:
        self.stage = stage
        self.dtype = dtype
        self.comm = comm
        self.streams = streams
        self.params = params
        self._stepped = stepped
        self.starts = [u.shard_offset for u in stepped]  # rank-flat, ascending
        largest = max((u.shard_numel for u in stepped), default=0)
        self._staging = host_empty(largest, dtype, crosses_pcie=True) if staging else None
        self._staged_bytes = 0  # new values copied into the staging buffer, ever
        # units whose new values the updater writes in place (their targets), until stored
        self._targeted: dict[int, torch.Tensor] = {}

    @property
    def copied_bytes(self) -> int:
        """New parameter values copied on the host so far (staging, parameter store)."""
        return self._staged_bytes + (0 if self.params is None else self.params.copied_bytes)

    def targets(self, lo: int, hi: int) -> tuple[int, int, torch.Tensor] | None:
        """Where the first new values of rank-flat [lo, hi) that have a place belong: a
        stage-3 shard's host memory in the parameter store (its resident slice, or the
        buffer it is written to disk from), so that the updater writes them there and
        nothing is copied after; None: no unit in [lo, hi) has one."""
        if self.params is None:
            return None
        first = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        for u in self._stepped[first:]:
            start, end = u.shard_offset, u.shard_offset + u.shard_numel
            if start >= hi:
                break
            if end <= lo or not u.sharded_params:
                continue
            dest = self._targeted.get(u.index)
            if dest is None:
                dest = self.params.target(u)
                if dest is None:
                    continue
                self._targeted[u.index] = dest
            a, b = max(lo, start), min(hi, end)
            return a, b, dest[a - start : b - start]
        return None

    def sink(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """New values for rank-flat [lo, hi): store every unit completed by them. A unit
        the updater wrote in place (:meth:`targets`) is stored from there; others go to
        :meth:`write` (one cut by a sub-group boundary waits in the staging buffer)."""
        first = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        for u in self._stepped[first:]:
            start, end = u.shard_offset, u.shard_offset + u.shard_numel
            if start >= hi:
                break
            dest = self._targeted.get(u.index)
            if dest is not None:  # written in place by the updater
                if end <= hi:
                    assert self.params is not None
                    del self._targeted[u.index]
                    self.params.put(u, dest)
                continue
            if start >= lo and end <= hi:
                self.write(u, values[start - lo : end - lo])
                continue
            assert self._staging is not None, "only NVMe sub-groups cut units"
            a, b = max(lo, start), min(hi, end)
            if a == start:  # a copy issued above may still read the staging buffer
                self.streams.sync_h2d()
            self._staging[a - start : b - start].copy_(values[a - lo : b - lo])
            self._staged_bytes += (b - a) * self._staging.element_size()
            if b == end:
                self.write(u, self._staging[: u.shard_numel])
        self.streams.sync_h2d()  # copies issued above read ``values`` (and the staging)

    def write(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        """Write a unit's updated shard into its compute-dtype parameters. A host shard goes
        to an accelerator on the host-to-device stream; the all-gather waits for it on the
        device, and the next unit's copy runs while this unit's all-gather does."""
        if unit.sharded_params:
            assert self.params is not None
            self.params.put(unit, shard.to(self.dtype))
        elif self.stage.all_reduces:
            if unit.full.data_ptr() != shard.data_ptr():  # else the step wrote them in place
                unit.full.copy_(shard)
        elif shard.device.type == "cpu" and self.streams.cuda:
            values, copied = self.streams.to_device(shard, self.dtype)
            self.streams.wait(copied)
            self.streams.handed_over(values)
            self.comm.all_gather(unit.full, values)
            if copied is not None:  # the caller reuses ``shard`` when this returns
                copied.synchronize()
        else:
            self.comm.all_gather(unit.full, shard.to(device=unit.full.device, dtype=self.dtype))

    def targeted_ends(self) -> list[int]:
        """The rank-flat ends of the units written in part in place (each holds its target,
        a store buffer, until its last values arrive)."""
        return [u.shard_offset + u.shard_numel for u in self._stepped if u.index in self._targeted]

    def forget(self) -> None:
        """After a failed update: give back the targets of the values it did not store."""
        self._targeted.clear()
        if self.params is not None:
            self.params.give_back()

    def add_to(self, report: MemoryReport) -> None:
        if self._staging is not None:  # small, outside host_memory_limit: only its lock counts
            report.pinned_bytes += pinned_nbytes(self._staging)
        if self.params is not None:
            self.params.add_to(report)

    def release_staging(self) -> None:
        """Unpin the buffer that assembles cut units (the parameter store is closed by its
        owner, the engine)."""
        unpin(self._staging)
