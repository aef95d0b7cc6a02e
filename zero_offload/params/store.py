"""Stage 3: where each rank's low-precision parameter shards live between uses.

``offload_param="none"`` keeps them in one rank-flat buffer on the device, ``"cpu"`` in host
memory (pinned with CUDA), ``"nvme"`` in one file per unit behind a small pool of host buffers
(``prefetch_depth + 2`` of them, so reads for the next modules run while one computes, and
with the optimizer on NVMe one more per unit a sub-group's step puts, at least 4:
:func:`.sizing.param_pool_buffers`). With ``offload_param_fraction`` the leading units (in
rank-flat order) keep their shards in host memory instead and only the rest are in files
(:func:`.sizing.param_host_numel`; ``estimate_memory`` counts by the same rules).
The optimizer writes new values through :meth:`put` after a step — the only time a shard
changes, so a shard is written back only then. An update that runs on under the next forward
(``overlap_step``) stores a unit before its shard is read: :attr:`before_read`. A CPU
optimizer asks :meth:`target` first for the host memory a unit's new values belong in (the
resident slice, or a pool buffer that is written to disk from where it is) and writes them
there, so that :meth:`put` copies nothing;
``copied_bytes`` counts the bytes that :meth:`put` did copy on the host. The gatherer takes a
unit's shard on the compute device through :meth:`lend` (with CUDA: copied on the
host-to-device stream; on a CPU device, the buffer an NVMe read filled, until the all-gather
has read it); :meth:`load` gives a copy of the caller's own.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

import torch

from ..config import ZeroConfig
from ..device.streams import Streams
from ..memory.ledger import MemoryReport
from ..swap.buffers import HostBuffer
from ..swap.io import DEFAULT_QUEUE_DEPTH
from ..swap.pinned import host_empty, pinned_nbytes, pins, unpin
from ..swap.swapper import Swapper
from .sizing import param_pool_buffers
from .units import FlatUnit

__all__ = ["Lent", "ParamStore"]

HELD_RESERVE = 1
"""Pool buffers never held by gathered units (:meth:`ParamStore.can_hold`): the one left
always serves the read that is needed now (reads ahead give theirs up for it, a write in
flight ends on its own, and a write-back's targets are put once :attr:`ParamStore.lent_out`
says so)."""


class Lent(NamedTuple):
    """A unit's shard lent for its all-gather by :meth:`ParamStore.lend`."""

    shard: torch.Tensor
    """The shard on the compute device."""
    ready: "torch.cuda.Event | None"
    """Fires once ``shard`` is there (None: it is there now)."""
    give_back: Callable[[], None] | None
    """Where ``shard`` is the pool buffer an NVMe read filled (a CPU device: no copy of
    it): the call that gives the buffer back once the caller is done with it."""
    kept: bool
    """``shard`` is the store's own memory, lent to be the gathered unit's until
    ``give_back`` (None: until the unit's next :meth:`ParamStore.put`)."""


class ParamStore:
    def __init__(
        self,
        cfg: ZeroConfig,
        numel: int,
        largest_shard: int,
        dtype: torch.dtype,
        device: torch.device,
        rank: int,
        host_memory_limit: int | None,
        streams: Streams,
        host_numel: int = 0,
        io_threads: int = DEFAULT_QUEUE_DEPTH,
        units_per_group: int = 0,
    ) -> None:
        """``host_numel``: with ``offload_param="nvme"``, the rank-flat prefix kept in host
        memory (whole units, :func:`.sizing.param_host_numel`). ``io_threads``: NVMe requests in
        flight (the rank's thread budget)."""
        self.tier = cfg.offload.param_tier
        self.streams = streams
        self.wait_s = 0.0  # time spent waiting for NVMe reads (prefetch misses)
        self.unread_ahead = 0  # gathers whose NVMe read was not started ahead
        self.given_up_ahead = 0  # reads ahead given back for room before a gather used them
        self._writes: list[Future] = []
        self._prefetched: dict[int, FlatUnit] = {}  # reads started ahead, not yet gathered
        self.resident: torch.Tensor | None = None
        self.dtype = dtype
        self.copied_bytes = 0  # new values copied on the host by put (none when targeted)
        self._lent: dict[int, HostBuffer] = {}  # pool buffers handed out by target()
        self._held: set[int] = set()  # units whose gathered memory is their pool buffer
        # called before a unit's shard is read (an update still running stores it first)
        self.before_read: Callable[[FlatUnit], None] | None = None
        self.swapper: Swapper | None = None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self._bytes = numel * itemsize
        # NVMe: the leading units' shards in host memory (empty when all are in files)
        self.host_numel = host_numel if self.tier.on_nvme else 0
        self.host = (
            host_empty(self.host_numel, dtype, crosses_pcie=True) if self.tier.on_nvme else None
        )
        if self.tier.on_nvme:
            self.swapper = Swapper(
                cfg.offload.nvme_dir,
                buffer_bytes=largest_shard * itemsize,
                buffer_count=param_pool_buffers(
                    cfg.prefetch_depth, cfg.offload.optimizer_tier.on_nvme, units_per_group
                ),
                min_buffers=1,
                host_memory_limit=host_memory_limit,
                expected_bytes=self._bytes - self.host_numel * itemsize,
                rank=rank,
                pin=pins(crosses_pcie=True),
                io_threads=io_threads,
            )
        else:
            self.resident = (
                host_empty(numel, dtype, crosses_pcie=True)
                if self.tier.on_host  # pinned; a CPU device's buffer is host memory anyway
                else torch.empty(numel, dtype=dtype, device=device)
            )

    @staticmethod
    def _key(unit: FlatUnit) -> str:
        return f"param.{unit.index}"

    def view(self, unit: FlatUnit) -> torch.Tensor | None:
        """The unit's slice of the resident buffer, or of the host part of an NVMe store
        (None: the unit's shard is in a file)."""
        end = unit.shard_offset + unit.shard_numel
        if self.resident is not None:
            return self.resident[unit.shard_offset : end]
        if end <= self.host_numel and self.host is not None:
            return self.host[unit.shard_offset : end]
        return None

    @property
    def reads_from_disk(self) -> bool:
        return self.swapper is not None

    def target(self, unit: FlatUnit) -> torch.Tensor | None:
        """Host memory (compute dtype, the shard's size) for the unit's next :meth:`put`
        to be written into in place: its slice in host memory, or an NVMe pool buffer held
        until that put (or :meth:`give_back`). None: the shard lives on an accelerator."""
        view = self.view(unit)
        if view is not None:  # device memory of an accelerator takes put()'s stream copy
            on_accelerator = not self.tier.offloaded and self.streams.cuda
            return None if on_accelerator or view.device.type != "cpu" else view
        assert self.swapper is not None
        buf = self._lent.get(unit.index)
        if buf is None:
            self._make_room(stale=unit.index)  # reads ahead give way to a write
            nbytes = unit.shard_numel * torch.empty(0, dtype=self.dtype).element_size()
            buf = self._lent[unit.index] = self.swapper.acquire(nbytes, self._key(unit))
        return buf.view(self.dtype, (unit.shard_numel,))

    @property
    def lent_out(self) -> bool:
        """Every pool buffer is held by :meth:`target` for a put to come or by a gathered
        unit: a read now would wait for a buffer that only such a put gives back."""
        return self.swapper is not None and len(self._lent) + len(self._held) >= (
            self.swapper.pool.count
        )

    def give_back(self) -> None:
        """Return the buffers of targets that were never put (a step that failed)."""
        assert self.swapper is not None or not self._lent
        lent, self._lent = self._lent, {}
        for buf in lent.values():
            assert self.swapper is not None
            self.swapper.pool.release(buf)

    def put(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        """Store new values of the unit's shard. An NVMe write runs on while the caller goes
        on (a later read of the unit waits for it); :meth:`flush` waits for all and raises the
        first failure. Into device memory from the host, the copy runs on the host-to-device
        stream: the caller keeps ``shard`` unchanged until ``streams.sync_h2d()`` (or
        :meth:`flush`); otherwise it may reuse ``shard`` at once. ``shard`` may be the
        unit's :meth:`target`: then nothing is copied."""
        view = self.view(unit)
        if view is not None:
            if view.data_ptr() == shard.data_ptr():
                pass  # the step wrote it in place (the unit's target, or the fp32 master)
            elif not self.tier.offloaded:  # to the device, on the host-to-device stream
                self.streams.copy_into(view, shard)
            else:
                self.copied_bytes += view.numel() * view.element_size()
                view.copy_(shard)
            return
        assert self.swapper is not None
        assert unit.index not in self._held, "a gathered unit's shard changed under it"
        buf = self._lent.pop(unit.index, None)
        if unit.index in self._prefetched:  # a write makes the read ahead stale: it goes
            self.swapper.release(self._key(self._prefetched.pop(unit.index)))
        if buf is not None and shard.data_ptr() == buf.data_ptr:
            # the buffer stays as the unit's read ahead: the next gather takes the new values
            # from it, no disk read (_make_room gives it back when room is needed)
            self._writes.append(self.swapper.swap_out(self._key(unit), shard, owned=buf, keep=True))
            self._prefetched[unit.index] = unit
            return
        if buf is not None:  # a target not used after all
            self.swapper.pool.release(buf)
        self._make_room()  # reads ahead give way to a write that needs a buffer
        self.copied_bytes += shard.numel() * shard.element_size()
        self._writes.append(self.swapper.swap_out(self._key(unit), shard, copy=True))

    def flush(self) -> None:
        """Wait until every :meth:`put` is stored."""
        self.streams.sync_h2d()
        writes, self._writes = self._writes, []
        for fut in writes:
            fut.result()

    def prefetch(self, unit: FlatUnit) -> None:
        """Start reading an NVMe shard into a host buffer (no-op for resident shards). Never
        waits for a buffer: with fewer than two free (one stays for the read that cannot
        wait), the read simply is not started ahead."""
        if self.swapper is None or unit.index in self._prefetched or self.view(unit) is not None:
            return
        if self.before_read is not None:
            self.before_read(unit)
        if self.swapper.pool.available < 2:
            return
        self.swapper.prefetch(self._key(unit))
        self._prefetched[unit.index] = unit

    def load(self, unit: FlatUnit) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """The unit's shard on the compute device, a tensor of the caller's own, and the
        event after which it is there (None: it is there now)."""
        shard, copied, give_back, _ = self.lend(unit)
        if give_back is not None:  # the pool buffer itself: copied out of it
            try:
                shard = shard.clone()
            finally:
                give_back()
        return shard, copied

    def lend(self, unit: FlatUnit, keep: bool = False) -> Lent:
        """The unit's shard on the compute device, for its all-gather (see :class:`Lent`).
        From host memory the copy runs on the host-to-device stream; from NVMe the read is
        waited for, and a buffer copied to an accelerator goes back to the pool at once.
        ``keep``: the caller would hold the shard's memory as the gathered unit's until
        ``give_back`` (one rank on a CPU device); a pool buffer is lent so only while
        :meth:`can_hold` (else ``Lent.kept`` is False: copy out of it, give it back)."""
        if self.before_read is not None:
            self.before_read(unit)
        view = self.view(unit)
        if view is not None:
            shard, event = self.streams.to_device(view)
            return Lent(shard, event, None, keep and shard is view)
        swapper = self.swapper
        assert swapper is not None
        if unit.index not in self._prefetched:
            self.unread_ahead += 1
            self._make_room()  # the read that is needed now comes first
        start = time.perf_counter()
        key = self._key(unit)
        host = swapper.prefetch(key).result()
        self.wait_s += time.perf_counter() - start
        self._prefetched.pop(unit.index, None)
        try:
            shard, copied = self.streams.to_device(host)
            if shard is host:  # the device is the host: lent as it is
                if keep and self.can_hold():
                    self._held.add(unit.index)
                    return Lent(shard, None, lambda: self._give_back_held(unit.index, key), True)
                return Lent(shard, None, lambda: swapper.release(key), False)
            if copied is not None:
                copied.synchronize()  # the copy itself, not the computation queued before it
        except BaseException:
            swapper.release(key)
            raise
        swapper.release(key)
        return Lent(shard, None, None, False)

    def can_hold(self) -> bool:
        """Whether one more pool buffer may stay lent as a gathered unit's memory (only the
        forward's and backward's progress gives it back)."""
        assert self.swapper is not None
        return len(self._held) + HELD_RESERVE < self.swapper.pool.count

    def _give_back_held(self, index: int, key: str) -> None:
        self._held.discard(index)
        assert self.swapper is not None
        self.swapper.release(key)

    def _make_room(self, stale: int | None = None) -> None:
        """With no pool buffer free, give back one read ahead for what is needed now:
        ``stale``'s own (the unit about to be written, whose read ahead the write makes
        stale), else the one needed last (the newest: reads ahead start in the order the
        pass will gather them). Dropping every read ahead instead made the next gathers
        read again what the update had just left in its buffers: at 99M, 20 of a forward's
        gathers a step."""
        assert self.swapper is not None
        if self.swapper.pool.available == 0 and self._prefetched:
            index = stale if stale in self._prefetched else next(reversed(self._prefetched))
            self.given_up_ahead += index != stale
            self.swapper.release(self._key(self._prefetched.pop(index)))

    def drop_prefetched(self) -> None:
        """Give back the buffers of reads ahead that no gather used (a changed module order,
        or room needed now); the disk copies stay."""
        if self.swapper is not None:
            for unit in list(self._prefetched.values()):
                self.swapper.release(self._key(unit))
            self._prefetched.clear()

    def add_to(self, report: MemoryReport) -> None:
        if self.resident is not None:
            report.add(
                self.tier,  # host or device: an NVMe store has no resident buffer
                "params",
                self._bytes,
                pinned=pinned_nbytes(self.resident),
            )
        else:
            assert self.swapper is not None and self.host is not None
            host_part = self.host.numel() * self.host.element_size()
            report.add("nvme", "params", self._bytes - host_part)
            report.add(
                "host",
                "params",
                self.swapper.host_buffer_nbytes + host_part,
                pinned=self.swapper.pool.pinned_nbytes + pinned_nbytes(self.host),
            )

    def close(self) -> None:
        self.give_back()
        unpin(self.resident)
        unpin(self.host)
        if self.swapper is not None:
            self.swapper.close()
