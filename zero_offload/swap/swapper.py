"""Where each named tensor shard lives (device / host / NVMe), and moving it between them.

Typical optimizer-step pipeline (one key per sub-group state tensor)::

    sw = Swapper("/mnt/nvme", buffer_bytes=shard_bytes, buffer_count=6)
    sw.swap_out("m.0", m0).result()            # first time: store it
    f = sw.prefetch("m.0")                      # read ahead into a pool buffer
    m = f.result()                              # typed view of that buffer (tier HOST)
    m.mul_(beta1) ...                           # compute in place
    w = sw.swap_out("m.0", m)                   # write back straight from the buffer
    ...; w.result(); sw.release("m.0")          # buffer back to the pool
    sw.close()                                  # files removed (also at normal exit)

Rules: one thread drives a Swapper (I/O completes on the engine's threads). Operations on
the same key are ordered: a new one first waits for the previous one on that key. A tensor
handed to ``swap_out`` must not change until its future is done. A failed write leaves the
key without a valid disk copy (``swap_in`` raises) instead of serving partial data; the
caller still holds the data and may retry. Files live in ``nvme_path/<run id>/rank<r>/``,
fresh per run, so a run never reads another run's files; the folder records its owner and goes
on close, garbage collection, normal exit and SIGTERM, or else at the next run (``runs``,
``signals``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future

import torch
from torch.profiler import record_function

from ..errors import SwapIOError
from ..interrupts import holds_signals
from ..policies import Tier
from .buffers import ALIGNMENT, BufferPool, HostBuffer, round_up
from .folder import SwapFolder
from .io import DEFAULT_QUEUE_DEPTH, FileIOEngine
from .keys import KeyEntry, Keys, direct_ok

__all__ = ["Tier", "Swapper"]


class Swapper:
    """Swap named tensor shards between device/host memory and files on NVMe.

    ``buffer_bytes``: size of each pool buffer (>= the largest shard that is not itself an
    aligned CPU tensor). ``buffer_count``: buffers wanted (prefetch depth + in-flight writes);
    the pool may get fewer under ``host_memory_limit`` but at least ``min_buffers``.
    ``expected_bytes``: bytes the run will store, checked against free space now.
    ``acquire_timeout``: seconds to wait for a free buffer before ``TimeoutError`` (no hang).
    Pass ``engine``/``pool`` to share them; owned ones are closed by :meth:`close`.
    ``pin``: page-lock the pool's buffers (default: when CUDA is available); ``False`` for
    buffers that never take part in a host<->accelerator copy. ``io_threads``: requests in
    flight of an owned engine (the rank's thread budget, ``device.threads``).
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike[str],
        buffer_bytes: int,
        *,
        buffer_count: int = 4,
        min_buffers: int = 1,
        host_memory_limit: int | None = None,
        expected_bytes: int = 0,
        rank: int = 0,
        run_id: str | None = None,
        engine: FileIOEngine | None = None,
        pool: BufferPool | None = None,
        acquire_timeout: float | None = 300.0,
        pin: bool | None = None,
        io_threads: int = DEFAULT_QUEUE_DEPTH,
    ) -> None:
        self._folder = SwapFolder(
            nvme_path,
            buffer_bytes,
            buffer_count=buffer_count,
            min_buffers=min_buffers,
            host_memory_limit=host_memory_limit,
            expected_bytes=expected_bytes,
            rank=rank,
            run_id=run_id,
            engine=engine,
            pool=pool,
            pin=pin,
            io_threads=io_threads,
        )
        self.nvme_path, self.run_id = self._folder.nvme_path, self._folder.run_id
        self.rank_dir = self._folder.rank_dir
        self.engine, self.pool = self._folder.engine, self._folder.pool
        self.acquire_timeout = acquire_timeout
        self._keys = Keys(self.rank_dir, self.pool)
        self._closed = False

    # ---- public API -------------------------------------------------------------------
    @record_function("zero_offload.swap_out")
    @holds_signals
    def swap_out(
        self,
        key: str,
        tensor: torch.Tensor,
        copy: bool = False,
        owned: HostBuffer | None = None,
        keep: bool = False,
    ) -> "Future[None]":
        """Write ``tensor``'s bytes to ``key``'s file; done when the disk copy is complete.
        ``copy``: stage the bytes in a pool buffer first, so the caller may reuse ``tensor``
        as soon as this returns (else it must not change until the future is done).
        ``owned``: a buffer from :meth:`acquire` that ``tensor`` starts; it is written from
        where it is (no copy) and goes back to the pool once written — or, with ``keep``,
        stays as ``key``'s host copy, so that a read that follows takes it without touching
        the disk (until :meth:`release`). An ``owned`` buffer that the arguments do not fit
        stays the caller's (``ValueError``); past that check it is the swapper's, and a
        failure (a full disk, a closed swapper) gives it back to the pool."""
        nbytes = tensor.numel() * tensor.element_size()
        padded = round_up(nbytes, ALIGNMENT)
        if owned is not None and (
            tensor.data_ptr() != owned.data_ptr
            or not tensor.is_contiguous()
            or padded > owned.nbytes
        ):
            raise ValueError(f"swap_out({key!r}): the tensor does not start its owned buffer")
        try:
            self._check_open()
            entry = self._keys.get(key)
            if entry is None:
                entry = self._new_entry(key, nbytes)
            self._keys.settle(entry)
        except BaseException:
            if owned is not None:
                self.pool.release(owned)
            raise
        release_after: HostBuffer | None = None
        if owned is not None:
            self._keys.drop_host(entry)
            owned.tensor[nbytes:padded].zero_()
            src = owned.tensor[:padded]
            if keep:
                with self._keys.lock:
                    entry.host, entry.writing_host = owned, True
            else:
                release_after = owned
        elif (
            entry.host is not None
            and tensor.device.type == "cpu"
            and tensor.data_ptr() == entry.host.data_ptr
            and tensor.is_contiguous()
            and entry.host.nbytes >= padded
        ):
            src = entry.host.tensor[:padded]  # writing back the buffer we lent out
        else:
            self._keys.drop_host(entry)  # any host copy is stale now
            if direct_ok(tensor) and not copy:
                src = tensor
            else:
                release_after = self._acquire(padded, key)
                release_after.tensor[nbytes:padded].zero_()
                release_after.tensor[:nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
                src = release_after.tensor[:padded]
        entry.nbytes, entry.dtype, entry.shape = nbytes, tensor.dtype, tuple(tensor.shape)
        entry.on_disk, entry.failed, entry.on_device = False, None, False

        def settle(io: Future, out: Future) -> None:
            exc = io.exception()
            if release_after is not None:
                self.pool.release(release_after)
            kept: HostBuffer | None = None
            with self._keys.lock:
                entry.failed, entry.on_disk = exc, exc is None
                if entry.writing_host and entry.release_when_written and exc is None:
                    kept, entry.host = entry.host, None  # released while it was written
                entry.writing_host = entry.release_when_written = False
            if kept is not None:
                self.pool.release(kept)
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(None)

        held = owned if keep else release_after  # given back if the write cannot start
        return self._track(entry, lambda: self.engine.write(entry.file, src), settle, held)

    @record_function("zero_offload.swap_in")
    @holds_signals
    def swap_in(self, key: str, out: torch.Tensor | None = None) -> "Future[torch.Tensor]":
        """Bring ``key`` back: into ``out`` (any device, same dtype and size), or, with no
        ``out``, into a pool buffer whose typed view is the result (held until :meth:`release`).
        Raises :class:`SwapIOError` now if the key has no valid copy."""
        self._check_open()
        entry = self._keys.valid(key)
        if out is not None and (
            out.dtype != entry.dtype or out.numel() * out.element_size() != entry.nbytes
        ):
            raise ValueError(
                f"swap_in({key!r}): out is {out.dtype} x {out.numel()}, stored is {entry.dtype} "
                f"{entry.shape}"
            )
        if entry.host is not None:  # already on host (prefetched or lent out)
            view = entry.host.view(entry.dtype, entry.shape)
            if out is None:
                return self._done(view)
            out.copy_(view)
            entry.on_device = out.device.type != "cpu"
            if entry.on_disk:
                self._keys.drop_host(entry)
            return self._done(out)
        if out is not None and direct_ok(out):
            target, buf = out, None
        else:
            buf = self._acquire(entry.padded, key)
            target = buf.tensor[: entry.padded]
            if out is None:
                entry.host = buf

        def settle(io: Future, fut: Future) -> None:
            exc = io.exception()
            if exc is not None:
                with self._keys.lock:
                    if entry.host is buf:
                        entry.host = None
                if buf is not None:
                    self.pool.release(buf)
                fut.set_exception(exc)
                return
            if out is None:
                assert buf is not None  # with no out, the read went into a pool buffer
                fut.set_result(buf.view(entry.dtype, entry.shape))
                return
            try:
                if buf is not None:
                    out.copy_(buf.view(entry.dtype, entry.shape))
                entry.on_device = out.device.type != "cpu"
            except BaseException as err:  # noqa: BLE001 - report through the future
                fut.set_exception(err)
                return
            finally:
                if buf is not None:
                    self.pool.release(buf)
            fut.set_result(out)

        return self._track(entry, lambda: self.engine.read(entry.file, target), settle, buf)

    @holds_signals
    def acquire(self, nbytes: int, key: str) -> HostBuffer:
        """A free pool buffer of at least ``nbytes`` for the caller to fill and hand to
        :meth:`swap_out` as ``owned`` (or give back with ``pool.release``)."""
        self._check_open()
        return self._acquire(round_up(nbytes, ALIGNMENT), key)

    @holds_signals
    def prefetch(self, key: str) -> "Future[torch.Tensor]":
        """Start reading ``key`` into a pool buffer (no new read if one holds it); the result
        is the same typed view :meth:`swap_in` with no ``out`` gives."""
        entry = self._keys.get(key)
        if entry is not None:
            with self._keys.lock:
                host = entry.host if entry.writing_host else None
                entry.release_when_written &= host is None  # held again, until release()
            if host is not None:  # being written from host memory: valid there already
                return self._done(host.view(entry.dtype, entry.shape))
        if entry is None or entry.host is None or entry.pending is None or entry.pending.done():
            return self.swap_in(key)
        fut: Future[torch.Tensor] = Future()

        def chain(prev: Future) -> None:  # a read or write-back on that buffer is in flight
            host = entry.host
            if host is None:
                fut.set_exception(
                    prev.exception()
                    or SwapIOError(entry.file, f"prefetch of {key!r}: buffer released")
                )
            else:
                fut.set_result(host.view(entry.dtype, entry.shape))

        entry.pending.add_done_callback(chain)
        return fut

    @holds_signals
    def release(self, key: str) -> None:
        """Return ``key``'s pool buffer (waiting for its I/O) and forget any device copy.
        The disk copy stays. Views of the buffer must not be used afterwards."""
        self._keys.release(key)

    @holds_signals
    def discard(self, key: str, *, at_once: bool = True) -> None:
        """Forget ``key`` entirely: buffer back to the pool, file deleted — now, or with
        ``at_once=False`` on a thread of its own (:meth:`.SwapFolder.remove_soon`), where the caller
        needs no room on the disk from it."""
        entry = self._keys.pop(key)
        if entry is None:
            return
        self._keys.settle(entry)
        self._keys.drop_host(entry)
        if at_once:
            self._folder.disk.remove(entry.file)
        else:
            self._folder.remove_soon(entry.file)

    @holds_signals
    def take_buffer(self, key: str) -> HostBuffer:
        """``key``'s host copy (what :meth:`prefetch` gave), as the caller's own buffer: the
        key keeps its disk copy only. Hand the buffer to :meth:`swap_out` as ``owned`` (or
        back with ``pool.release``): the caller may change it in place without the key's
        next read seeing the change."""
        return self._keys.take_buffer(key)

    @holds_signals
    def take_over(self, key: str, source: str) -> None:
        """Make ``source``'s stored copy ``key``'s, in constant time: ``key``'s own copy goes
        (buffer back to the pool, file deleted) and ``source`` is forgotten. Waits for
        ``source``'s write; raises :class:`SwapIOError` if it has no valid copy (``key`` is
        then unchanged)."""
        self._check_open()
        self._keys.valid(source)  # waits for its write; raises if it has no valid copy
        self.discard(key, at_once=False)
        self._keys.rename(source, key)

    def where(self, key: str) -> Tier | None:
        """Fastest tier holding a valid copy of ``key`` (None if none)."""
        entry = self._keys.get(key)
        if entry is None:
            return None
        if entry.on_device:
            return Tier.DEVICE
        if entry.host is not None and (entry.pending is None or entry.pending.done()):
            return Tier.HOST  # a failed read has already given its buffer back
        return Tier.NVME if entry.on_disk else None

    def nbytes_by_tier(self) -> dict[Tier, int]:
        """Shard bytes held per tier (a key may count in several); pool size is
        ``host_buffer_nbytes``."""
        out = {t: 0 for t in Tier}
        for e in self._keys.values():
            if e.on_device:
                out[Tier.DEVICE] += e.nbytes
            if e.host is not None:
                out[Tier.HOST] += e.host.nbytes
            if e.on_disk:
                out[Tier.NVME] += e.padded
        return out

    @property
    def host_buffer_nbytes(self) -> int:
        """Host memory of the buffer pool (allocated up front, used or not)."""
        return self.pool.nbytes

    def close(self) -> None:
        """Wait for all I/O, free buffers, delete this rank's files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._folder.finish_removals()
        self._keys.close()
        self._folder.close()

    def __enter__(self) -> "Swapper":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Swapper is closed")

    def _new_entry(self, key: str, nbytes: int) -> KeyEntry:
        self._folder.check_space(round_up(nbytes, ALIGNMENT))
        return self._keys.new(key)

    def _acquire(self, padded: int, key: str) -> HostBuffer:
        if padded > self.pool.buffer_bytes:
            raise ValueError(
                f"shard {key!r} needs {padded} bytes but pool buffers hold "
                f"{self.pool.buffer_bytes}; "
                "raise buffer_bytes or pass an aligned CPU tensor"
            )
        return self.pool.acquire(self.acquire_timeout)

    @staticmethod
    def _done(value: torch.Tensor) -> "Future[torch.Tensor]":
        fut: Future[torch.Tensor] = Future()
        fut.set_result(value)
        return fut

    def _track(self, entry: KeyEntry, start, settle, buf: HostBuffer | None) -> Future:
        """Start an engine request; ``settle(io_future, our_future)`` runs on completion."""
        fut: Future = Future()
        try:
            io = start()
        except BaseException:
            with self._keys.lock:
                if entry.host is buf and buf is not None:
                    entry.host = None
            if buf is not None:
                self.pool.release(buf)
            raise
        entry.pending = fut
        io.add_done_callback(lambda f: settle(f, fut))
        return fut
