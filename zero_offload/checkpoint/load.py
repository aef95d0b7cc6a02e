"""Load: every rank rebuilds its own shards, unit by unit, from whichever stored ranks hold
those elements — so a checkpoint saved on N ranks loads on M ranks, in any stage.

Nothing is used before it is checked: the manifest's version, the parameter names and shapes,
and each stored file's size and checksums (the ranks split that work). The state then streams
one unit at a time into the optimizer's tier (device, host or NVMe) and the compute-dtype
parameters are recomputed from the master.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..progress import Progress
from ..params.units import persistent_buffers
from ..partition import mismatch_message
from .format import (
    CheckpointError,
    Manifest,
    load_plain,
    pieces,
    read_manifest,
    section_offset,
    verify_rank_file,
)
from .tags import resolve_tag, tag_folder

if TYPE_CHECKING:
    from ..engine.engine import Engine

__all__ = ["load_checkpoint", "check_names"]

log = logging.getLogger(__name__)


def check_names(manifest: Manifest, expected: dict[str, tuple[int, ...]], where: Path) -> None:
    """The stored parameters must be exactly the model's, with the same shapes."""
    stored = {name: tuple(slot.shape) for name, (_, slot) in manifest.slots_by_name().items()}
    problem = mismatch_message(
        "checkpoint",
        set(expected) - set(stored),
        set(stored) - set(expected),
        [
            f"{n}: stored {stored[n]}, model {expected[n]}"
            for n in set(stored) & set(expected)
            if stored[n] != expected[n]
        ],
    )
    if problem:
        raise CheckpointError(f"{where}: {problem}")


def _verify(engine: "Engine", folder: Path, manifest: Manifest) -> None:
    """Ranks check the stored files round-robin, then agree that all are sound."""
    comm = engine.comm
    error = None
    for i in range(comm.rank, len(manifest.ranks), comm.world_size):
        try:
            verify_rank_file(folder / manifest.ranks[i].file, manifest.ranks[i])
        except CheckpointError as exc:
            error = str(exc)
            break
    errors = [e for e in comm.all_gather_object(error) if e]
    if errors:
        raise CheckpointError(errors[0])


class _Reader:
    """Positioned reads from the stored rank files into tensors."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder, self.manifest = folder, manifest
        self._fds: dict[int, int] = {}

    def read(self, rank: int, section: int, element: int, out: torch.Tensor) -> None:
        record = self.manifest.ranks[rank]
        if rank not in self._fds:
            self._fds[rank] = os.open(self.folder / record.file, os.O_RDONLY)
        view = out.numpy().data.cast("B")
        offset = section_offset(record.numel, section, element)
        while view:
            got = os.preadv(self._fds[rank], [view], offset)
            if got <= 0:
                raise CheckpointError(f"{self.folder / record.file}: ends early at byte {offset}")
            view, offset = view[got:], offset + got

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _set_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]  # keys: a tensor (an array before)
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _restore_extra(engine: "Engine", folder: Path, lr_scheduler: Any) -> None:
    comm = engine.comm
    own = folder / f"rank{comm.rank}.extra.pt"
    path = own if own.exists() else folder / "rank0.extra.pt"
    extra = load_plain(path)
    first = extra if path.name == "rank0.extra.pt" else load_plain(folder / "rank0.extra.pt")
    engine.load_training_state(extra)
    if path == own:  # RNG streams belong to a rank; a new rank keeps its own
        _set_rng(extra["rng"])
    if lr_scheduler is not None and first.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(first["lr_scheduler"])
    buffers = persistent_buffers(engine.module)
    for name, value in first.get("buffers", {}).items():
        if name in buffers:
            buffers[name].copy_(value)


def load_checkpoint(
    engine: "Engine", directory: str | os.PathLike, tag: str | None = None, lr_scheduler: Any = None
) -> str:
    """Restore params, optimizer state, step counts, loss scaler and RNG; returns the tag.
    Collective: every rank must call it."""
    root = Path(directory)
    tag = resolve_tag(root, tag)
    folder = tag_folder(root, tag)
    manifest = read_manifest(folder)
    check_names(
        manifest,
        {n: tuple(s.shape) for u in engine.units for n, s in zip(u.names, u.layout.slots)},
        folder / "manifest.json",
    )
    _verify(engine, folder, manifest)
    stored = manifest.slots_by_name()
    rank = engine.comm.rank
    reader = _Reader(folder, manifest)
    progress = Progress(
        f"loading checkpoint {folder}",
        sum(u.shard_numel for u in engine.units),
        "parameters",
        show=rank == 0,
        logger=log,
    )
    try:
        for unit in engine.units:
            arrays = [torch.zeros(unit.shard_numel, dtype=torch.float32) for _ in range(3)]
            shard = 0 if unit.layout.num_shards == 1 else rank
            for o in unit.layout.overlaps(shard):
                old_unit, old_slot = stored[unit.layout.slots[o.slot].name]
                for src_rank, element, count, at in pieces(
                    old_unit, old_slot, o.slot_start, o.slot_end
                ):
                    dst = o.shard_start + at
                    for section, array in enumerate(arrays):
                        reader.read(src_rank, section, element, array[dst : dst + count])
            engine.load_unit_state(unit, *arrays)
            progress.update(unit.shard_numel)
        engine.finish_load()
    finally:
        progress.close()
        reader.close()
    _restore_extra(engine, folder, lr_scheduler)
    return tag
