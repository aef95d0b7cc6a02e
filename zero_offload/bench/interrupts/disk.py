"""Filling a disk fault's tmpfs at a moment the run under test is between saves."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

from zero_offload.checkpoint.format import MANIFEST

__all__ = ["fill_between_saves"]


def _settled_checkpoint(ckpt: Path) -> int:
    """The bytes (allocated blocks) of ``ckpt`` when it holds one complete checkpoint and no
    save or clean-up is under way; 0 otherwise."""
    folders = [p for p in ckpt.iterdir() if p.is_dir()] if ckpt.is_dir() else []
    if len(folders) != 1 or folders[0].name.startswith(".") or not (folders[0] / MANIFEST).exists():
        return 0
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    if any(p.name.endswith(".tmp") for p in files):
        return 0
    return sum(p.stat().st_blocks * 512 for p in files)


def fill_between_saves(
    proc: subprocess.Popen, ckpt: Path, mount: Path, rng: random.Random, below: int = 0
) -> int:
    """Fill the disk so that fewer bytes stay free than one checkpoint takes (and than
    ``below``, when given); returns them.

    The process is stopped while the disk is measured and filled, at a moment no save is
    under way (one complete checkpoint on disk). Measured mid-save, the half-written
    checkpoint would count as used space that the save later frees."""
    while True:
        proc.send_signal(signal.SIGSTOP)
        try:
            footprint = _settled_checkpoint(ckpt)
            if footprint:
                left = rng.randrange(0, max(1, min(footprint, below or footprint)))
                free = shutil.disk_usage(mount).free
                with open(mount / "ballast", "ab") as f:  # the disk fills up
                    try:
                        f.write(b"\0" * max(0, free - left))
                    except OSError:
                        pass
                return left
        finally:
            proc.send_signal(signal.SIGCONT)
        if proc.poll() is not None:
            return 0
        time.sleep(rng.uniform(0, 0.05))
