"""Run folders under ``nvme_path``: made with an owner record, removed by their owner, and
swept by the next run when their owner died without removing them.

Layout: ``nvme_path/<run id>/rank<r>/``; the rank folder belongs to one process and holds
``owner.json`` = ``{"host", "pid", "start_time"}``. ``start_time`` is the process's creation
time (``psutil``), so a pid reused by a later process does not pass for the owner. A folder
is removed by a later run only when its owner ran on this host and is gone (or a zombie);
folders of live processes, of other hosts (a shared filesystem) and without an owner record
(not ours, or a run of an older version) are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

__all__ = [
    "OWNER_FILE",
    "Owner",
    "new_run_id",
    "make_rank_dir",
    "remove_rank_dir",
    "remove_dead_runs",
]

logger = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
CLAIM_PREFIX = ".stale-"
"""A dead run's folder is renamed ``.stale-<pid>-<random>`` by the process removing it, so two
runs starting together never remove (and report) the same folder twice."""
RANK_DIR = re.compile(r"rank\d+")
"""Names of the rank folders a Swapper makes; nothing else under nvme_path is looked into."""
START_TIME_TOLERANCE = 1.0
"""Seconds two readings of one process's start time may differ (the boot time they are
derived from is re-read and whole-second rounded); a reused pid starts much later."""


@dataclass(frozen=True)
class Owner:
    """The process that made a rank folder."""

    host: str
    pid: int
    start_time: float

    @classmethod
    def current(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time())

    @classmethod
    def read(cls, folder: Path) -> "Owner | None":
        """The folder's owner, or None when it has no readable record."""
        try:
            raw = json.loads((folder / OWNER_FILE).read_text())
            return cls(str(raw["host"]), int(raw["pid"]), float(raw["start_time"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def is_dead(self) -> bool:
        """True only when this owner ran on this host and its process is gone."""
        if self.host != socket.gethostname():
            return False
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.start_time) > START_TIME_TOLERANCE:
                return True  # the pid now belongs to another process
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:  # AccessDenied and the like: it exists, assume it is alive
            return False


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}"


def make_rank_dir(rank_dir: Path) -> None:
    """Create ``rank_dir`` (not existing before) and record this process as its owner; the
    record is written whole (temporary file, then rename) so a sweeper never reads half."""
    rank_dir.mkdir(parents=True, exist_ok=False)
    try:
        tmp = rank_dir / f".{OWNER_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(Owner.current())))
        os.replace(tmp, rank_dir / OWNER_FILE)
    except BaseException:
        remove_rank_dir(rank_dir)
        raise


def remove_rank_dir(rank_dir: Path) -> None:
    """Remove a rank folder and, when no other rank uses it any more, its run folder."""
    shutil.rmtree(rank_dir, ignore_errors=True)
    try:
        rank_dir.parent.rmdir()
    except OSError:
        pass


def _disk_bytes(folder: Path) -> int:
    """Bytes the folder's files take on disk (allocated blocks, as ``du`` counts)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _claimer_alive(folder: Path) -> bool:
    """Whether the process that claimed this folder for removal still runs."""
    try:
        pid = int(folder.name[len(CLAIM_PREFIX) :].split("-")[0])
    except ValueError:
        return False
    return pid != os.getpid() and psutil.pid_exists(pid)


def _dead_rank_dirs(nvme_path: Path) -> list[tuple[Path, str]]:
    """Rank folders to remove, each with who left it."""
    found: list[tuple[Path, str]] = []
    try:
        runs = [r for r in nvme_path.iterdir() if r.is_dir() and not r.is_symlink()]
    except OSError:
        return found
    for run in runs:
        try:
            ranks = [d for d in run.iterdir() if d.is_dir() and not d.is_symlink()]
        except OSError:
            continue
        for rank_dir in ranks:
            if not (RANK_DIR.fullmatch(rank_dir.name) or rank_dir.name.startswith(CLAIM_PREFIX)):
                continue  # not a folder this library makes
            if rank_dir.name.startswith(CLAIM_PREFIX):  # its owner was dead; its remover died too
                if not _claimer_alive(rank_dir):
                    found.append((rank_dir, "interrupted removal"))
                continue
            owner = Owner.read(rank_dir)
            if owner is not None and owner.is_dead():
                found.append((rank_dir, f"pid {owner.pid}"))
    return found


def remove_dead_runs(nvme_path: str | os.PathLike[str]) -> int:
    """Remove the rank folders under ``nvme_path`` whose owner on this host is dead; log what
    was freed; return the bytes freed."""
    nvme_path = Path(nvme_path)
    freed, removed = 0, []
    for rank_dir, who in _dead_rank_dirs(nvme_path):
        claimed = rank_dir.parent / f"{CLAIM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(rank_dir, claimed)
        except OSError:
            continue  # another run got there first
        freed += _disk_bytes(claimed)
        remove_rank_dir(claimed)
        removed.append(f"{rank_dir.relative_to(nvme_path)} ({who})")
    if removed:
        logger.warning(
            "removed %d swap folder(s) left under nvme_path=%s by runs that ended without "
            "cleaning up (killed or crashed): %s; freed %d bytes (%.2f GiB)",
            len(removed),
            os.fspath(nvme_path),
            ", ".join(removed),
            freed,
            freed / 2**30,
        )
    return freed
