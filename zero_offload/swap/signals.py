"""Remove this process's swap folders when SIGTERM or SIGINT is about to kill it outright.

A signal left to its default action (SIGTERM in every Python process: how SLURM, Kubernetes,
torchrun and ``timeout`` stop a job; SIGINT where a launcher reset it) ends the process
without running any Python cleanup, so the swap folders would stay on disk. While a Swapper
is open, such a signal goes through a handler that removes this process's rank folders and
then raises the same signal again with its default action: the process still dies by it,
with the exit status a scheduler expects. When the last Swapper closes, the previous
disposition is put back.

A signal that already has a Python handler keeps it, untouched: Python's own SIGINT handler
(``KeyboardInterrupt``) or a user's handler runs Python code, so when it ends the process the
swappers' finalizers remove the folders at exit, and when it does not (``KeyboardInterrupt``
caught in a notebook; a handler that asks the loop to save a checkpoint, then stop) the run goes
on and still needs its files. Removing them first would break exactly those runs. An ignored
signal stays ignored. Handlers are installed from the main thread only (Python's rule). A
handler installed after ours that calls ours as its predecessor gets what it got from the
default disposition before (nothing: SIG_DFL cannot be called), so it keeps its behaviour.

What this cannot cover (SIGKILL, a handler that calls ``os._exit``, a process stuck inside a
C call until the scheduler's SIGKILL, a crash) is removed by the next run on the same
``nvme_path`` (:func:`zero_offload.swap.runs.remove_dead_runs`).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType

from .runs import remove_rank_dir

__all__ = ["watch", "forget", "SIGNALS"]

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Cleanup:
    """The rank folders this process owns, and the handlers standing in for default actions.
    One per process, as signal dispositions are."""

    def __init__(self) -> None:
        self.folders: dict[int, tuple[int, Path]] = {}  # token -> (owner pid, rank folder)
        self.tokens = itertools.count()
        self.replaced: dict[
            int, signal.Handlers
        ] = {}  # signal -> disposition we replaced (SIG_DFL)
        self.lock = threading.Lock()  # never taken in the handler: it may interrupt a holder

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if signal.getsignal(signum) != self.handle:
            # Called as the "previous handler" by one installed after us (frameworks chain to
            # callable predecessors and skip SIG_DFL, which we stand in for): do what they
            # expected of SIG_DFL, nothing. Their run goes on; the files go at exit.
            return
        for pid, folder in list(self.folders.values()):
            if pid == os.getpid():  # a forked child must not remove its parent's files
                remove_rank_dir(folder)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the default action: the process ends here
        os._exit(128 + signum)  # not reached unless the signal is blocked in this thread

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            if not self.replaced:
                logger.debug(
                    "swap folders made off the main thread: no SIGTERM handler (Python "
                    "installs them from the main thread only); the next run removes them"
                )
            return
        for sig in SIGNALS:
            if sig not in self.replaced and signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, self.handle)
                self.replaced[sig] = signal.SIG_DFL

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # left in place; with no folders it only re-raises the default action
        for sig, previous in list(self.replaced.items()):
            if signal.getsignal(sig) == self.handle:  # not if someone installed theirs since
                signal.signal(sig, previous)
            del self.replaced[sig]


_CLEANUP = _Cleanup()


def watch(rank_dir: Path) -> int:
    """Remove ``rank_dir`` if SIGTERM/SIGINT kills this process by default action; returns a
    token for :func:`forget`."""
    with _CLEANUP.lock:
        token = next(_CLEANUP.tokens)
        _CLEANUP.folders[token] = (os.getpid(), rank_dir)
        _CLEANUP.install()
    return token


def forget(token: int) -> None:
    """Stop watching a folder (it was removed); the last one puts the old dispositions back."""
    with _CLEANUP.lock:
        _CLEANUP.folders.pop(token, None)
        if not _CLEANUP.folders:
            _CLEANUP.uninstall()
