"""This rank's swap folder with the I/O engine and buffer pool that serve it: made checked
(writable, room enough) and removed however the run ends, apart from what a Swapper keeps in it.
"""

from __future__ import annotations

import logging
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import SwapIOError, SwapSpaceError
from . import signals
from .buffers import ALIGNMENT, BufferPool, HostBuffer
from .disk import Disk, current_disk
from .io import DEFAULT_QUEUE_DEPTH, FileIOEngine
from .runs import make_rank_dir, new_run_id, remove_dead_runs, remove_rank_dir

__all__ = ["FILES", "FileDisk", "SwapFolder"]

logger = logging.getLogger(__name__)


def _cleanup(
    engine: FileIOEngine | None, pool: BufferPool | None, rank_dir: Path, pid: int, token: int
) -> None:
    """Finalizer: stop owned I/O, free owned buffers, remove this rank's files."""
    if os.getpid() != pid:
        return  # a forked child: the folder, threads and buffers are its parent's
    if engine is not None:
        engine.close()
    if pool is not None:
        pool.close()
    remove_rank_dir(rank_dir)  # the run folder too once no other rank uses it
    signals.forget(token)


class FileDisk:
    """The real disk (:class:`~.disk.Disk`): files, direct I/O, page-aligned host memory."""

    def io_engine(self, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> FileIOEngine:
        return FileIOEngine(queue_depth=queue_depth)

    def free_bytes(self, path: Path) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def host_buffer(self, nbytes: int, *, huge_pages: bool, pin: bool | None) -> HostBuffer:
        return HostBuffer(nbytes, huge_pages=huge_pages, pin=pin)


FILES = FileDisk()


class SwapFolder:
    """``nvme_path/<run id>/rank<r>/`` of one Swapper, its engine and pool (see
    :class:`~.swapper.Swapper` for the arguments); owned ones are closed by :meth:`close`."""

    def __init__(
        self,
        nvme_path: str | os.PathLike[str],
        buffer_bytes: int,
        *,
        buffer_count: int,
        min_buffers: int,
        host_memory_limit: int | None,
        expected_bytes: int,
        rank: int,
        run_id: str | None,
        engine: FileIOEngine | None,
        pool: BufferPool | None,
        pin: bool | None,
        io_threads: int,
    ) -> None:
        self.nvme_path = Path(nvme_path)
        self.disk: Disk = current_disk() or FILES  # files, or a rehearsal's simulated disk
        self.run_id = run_id or new_run_id()
        self.rank_dir = self.nvme_path / self.run_id / f"rank{rank}"
        remove_dead_runs(self.nvme_path)  # folders of runs that were killed before cleaning up
        try:
            make_rank_dir(self.rank_dir)
        except FileExistsError as exc:
            raise SwapIOError(
                self.rank_dir,
                "swap directory already exists; a run never reuses another run's files (use a new "
                "run_id)",
            ) from exc
        except OSError as exc:
            raise SwapIOError.from_oserror(
                exc, self.nvme_path, None, None, "nvme_path: cannot create swap directory"
            ) from exc
        owned_engine = engine is None
        owned_pool = pool is None
        try:
            self.check_space(expected_bytes)
            self.engine = engine if engine is not None else self.disk.io_engine(io_threads)
            self.pool = (
                pool
                if pool is not None
                else BufferPool(
                    buffer_bytes,
                    buffer_count,
                    minimum=min_buffers,
                    host_memory_limit=host_memory_limit,
                    pin=pin,
                )
            )
            self._finalizer = weakref.finalize(
                self,
                _cleanup,
                self.engine if owned_engine else None,
                self.pool if owned_pool else None,
                self.rank_dir,
                os.getpid(),
                signals.watch(self.rank_dir),
            )
            self._probe_writable()
        except BaseException:
            if hasattr(self, "_finalizer"):
                self._finalizer()
            else:
                if owned_engine and hasattr(self, "engine"):
                    self.engine.close()
                if owned_pool and hasattr(self, "pool"):
                    self.pool.close()
                remove_rank_dir(self.rank_dir)
            raise
        self._remover: ThreadPoolExecutor | None = None  # deletes files of replaced copies

    def check_space(self, needed: int) -> None:
        available = self.disk.free_bytes(self.rank_dir)
        if needed > available:
            raise SwapSpaceError(self.nvme_path, needed, available)

    def _probe_writable(self) -> None:
        """Write and delete one aligned block now, so a read-only path fails at construction."""
        probe = self.rank_dir / ".probe"
        with self.pool.borrow(timeout=30) as buf:
            try:
                self.engine.write(probe, buf.tensor[:ALIGNMENT]).result()
            except OSError as exc:
                raise SwapIOError(self.nvme_path, f"nvme_path is not writable: {exc}") from exc
            finally:
                self.disk.remove(probe)

    def remove_soon(self, path: Path) -> None:
        """Delete a file no key names any more on a thread of its own: unlinking a large
        file takes the file system ~10 ms, which the caller need not wait for. Files are
        numbered by a running counter, so no new key can meet the file before it goes."""
        if self.disk is not FILES:  # a rehearsal's simulated disk: nothing to wait for
            self.disk.remove(path)
            return
        if self._remover is None:
            self._remover = ThreadPoolExecutor(1, thread_name_prefix="zo-swap-remove")

        def removed(done: Future) -> None:
            if done.exception() is not None:  # the run's folder goes at close anyway
                logger.warning("could not delete swap file %s: %s", path, done.exception())

        self._remover.submit(self.disk.remove, path).add_done_callback(removed)

    def finish_removals(self) -> None:
        """Wait for the files :meth:`remove_soon` is deleting."""
        if self._remover is not None:
            self._remover.shutdown(wait=True)

    def close(self) -> None:
        """Stop owned I/O, free owned buffers, remove the folder (once)."""
        self._finalizer()
