"""A Swapper's per-key bookkeeping: each key's file, host copy and what holds a valid copy,
kept under one lock apart from the I/O that changes it.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SwapIOError
from .buffers import ALIGNMENT, BufferPool, HostBuffer, round_up

__all__ = ["KeyEntry", "Keys", "direct_ok"]

logger = logging.getLogger(__name__)


@dataclass
class KeyEntry:
    """Bookkeeping of one key; changed by the driving thread and by I/O completions."""

    file: Path
    nbytes: int = 0
    dtype: torch.dtype = torch.uint8
    shape: tuple[int, ...] = ()
    on_disk: bool = False  # the file holds the latest swap_out completely
    failed: BaseException | None = None  # why the latest swap_out failed
    host: HostBuffer | None = None  # pool buffer holding a valid copy (once `pending` is done)
    on_device: bool = False  # last swap_in went into a device tensor
    pending: Future | None = None  # latest operation on this key
    # a write of ``host`` (swap_out keep=True) is in flight: its bytes are valid already
    writing_host: bool = False
    release_when_written: bool = False  # release() came while it was: give ``host`` back then

    @property
    def padded(self) -> int:
        return round_up(self.nbytes, ALIGNMENT)


def direct_ok(t: torch.Tensor) -> bool:
    """Can the engine use this tensor's memory as is (CPU, contiguous, aligned, padded size)?"""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.data_ptr() % ALIGNMENT == 0
        and (t.numel() * t.element_size()) % ALIGNMENT == 0
    )


class Keys:
    """The keys of one Swapper, each with its :class:`KeyEntry` and its own file in
    ``rank_dir``; ``lock`` guards the fields I/O completions change."""

    def __init__(self, rank_dir: Path, pool: BufferPool) -> None:
        self.rank_dir = rank_dir
        self.pool = pool
        self.lock = threading.Lock()
        self._entries: dict[str, KeyEntry] = {}
        # numbers the files: keys are cut to a safe prefix, so the number keeps names apart
        # (a count of the keys would come round again after a discard)
        self._file_numbers = itertools.count()

    def get(self, key: str) -> KeyEntry | None:
        return self._entries.get(key)

    def values(self) -> Iterable[KeyEntry]:
        return self._entries.values()

    def new(self, key: str) -> KeyEntry:
        """A new entry for ``key`` with a file name no other key has had in this folder."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:48]
        entry = KeyEntry(self.rank_dir / f"{next(self._file_numbers):06d}-{safe}.swp")
        self._entries[key] = entry
        return entry

    def valid(self, key: str) -> KeyEntry:
        """``key``'s entry once its I/O is done; :class:`SwapIOError` if it has no valid copy."""
        entry = self._entries.get(key)
        if entry is None:
            raise SwapIOError(None, f"swap_in of key {key!r}: never written")
        self.settle(entry)
        if entry.host is None and not entry.on_disk:
            cause = f"last swap_out failed ({entry.failed})" if entry.failed else "never written"
            raise SwapIOError(entry.file, f"swap_in of key {key!r}: {cause}; no valid copy")
        return entry

    def pop(self, key: str) -> KeyEntry | None:
        return self._entries.pop(key, None)

    def rename(self, source: str, key: str) -> None:
        """``source``'s entry becomes ``key``'s (``key`` must have none)."""
        self._entries[key] = self._entries.pop(source)

    def release(self, key: str) -> None:
        """Give ``key``'s host buffer back once its I/O is done (as ``Swapper.release``)."""
        entry = self.get(key)
        if entry is None:
            return
        entry.on_device = False
        with self.lock:
            if entry.writing_host:  # its write still reads the buffer: given back once done
                entry.release_when_written = True
                return
        self.settle(entry)
        if entry.on_disk:
            self.drop_host(entry)
        elif entry.host is not None:
            logger.warning(
                "release(%r): the disk copy is not valid (last write failed); keeping its host "
                "buffer",
                key,
            )

    def take_buffer(self, key: str) -> HostBuffer:
        """``key``'s host copy, handed to the caller (as ``Swapper.take_buffer``)."""
        entry = self.valid(key)
        with self.lock:
            buf = None if entry.writing_host or not entry.on_disk else entry.host
            if buf is not None:
                entry.host = None
        if buf is None:
            raise SwapIOError(entry.file, f"take_buffer({key!r}): no host copy beside the file")
        return buf

    def drop_host(self, entry: KeyEntry) -> None:
        """Give ``entry``'s host buffer back to the pool."""
        with self.lock:
            buf, entry.host = entry.host, None
        if buf is not None:
            self.pool.release(buf)

    @staticmethod
    def settle(entry: KeyEntry) -> None:
        """Wait for the latest operation on ``entry``."""
        if entry.pending is not None:
            wait([entry.pending])

    def close(self) -> None:
        """Wait for every key's I/O, give back their buffers and forget them all."""
        wait([e.pending for e in self._entries.values() if e.pending is not None])
        for e in self._entries.values():
            self.drop_host(e)
        self._entries.clear()
