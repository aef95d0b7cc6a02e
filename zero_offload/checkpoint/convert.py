"""Import: a DeepSpeed ZeRO checkpoint (any :class:`~.source.Source` that knows which tensors
are parameters) written as this library's checkpoint format, which then loads at any world
size and stage and consolidates without DeepSpeed's reader. (A DCP folder cannot say which of
its tensors are frozen parameters and which buffers without the model: load it with
``engine.load_checkpoint``, which has the model.)

The output is one rank file holding every parameter end to end (one unit, one shard), written
in pieces of at most ``chunk`` elements per section: memory is three such pieces whatever the
model's size. The same atomic protocol as ``save``: a ``.<tag>.partial`` folder, the manifest
last, then the tag and ``latest``.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from ..progress import Progress
from .format import (
    MANIFEST,
    CheckpointError,
    Manifest,
    RankRecord,
    SlotRecord,
    UnitRecord,
    fsync_dir,
    section_offset,
    write_atomically,
)
from .source import Source
from .tags import LATEST, check_tag, commit_tag, recover_tag

__all__ = ["write_checkpoint", "import_deepspeed"]

log = logging.getLogger(__name__)


def _plain_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """The extra state as it is stored: plain data, buffers as tensors of their own."""
    out = {k: v for k, v in extra.items() if k not in ("buffers", "rng")}
    out["buffers"] = {n: extra["buffers"][n].clone() for n in extra.get("buffers", {})}
    return out


def write_checkpoint(
    source: Source,
    directory: str | os.PathLike,
    tag: str,
    stage: int,
    dtype: str = "float32",
    chunk: int = 1 << 22,
) -> Path:
    """Write ``source`` as the checkpoint ``directory/tag``; returns that folder."""
    root = Path(directory)
    tag = check_tag(tag)
    extra = _plain_extra(source.extra(0)[0])
    if source.optional:
        raise ValueError(f"{source.where}: which tensors are parameters needs the model")
    slots, offset = [], 0
    for name in source.shapes:
        numel = math.prod(source.shapes[name])
        slots.append(SlotRecord(name, list(source.shapes[name]), offset, numel))
        offset += numel
    total = offset
    root.mkdir(parents=True, exist_ok=True)
    recover_tag(root, tag)
    partial = root / f".{tag}.partial"
    partial.mkdir()
    path = partial / "rank0.state"
    crcs = [0, 0, 0]
    progress = Progress(f"importing {source.where}", total, "parameters", logger=log)
    fd = os.open(path.with_name(path.name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for slot in slots:
            for lo in range(0, slot.numel, chunk):
                hi = min(slot.numel, lo + chunk)
                arrays = [torch.zeros(hi - lo, dtype=torch.float32) for _ in range(3)]
                source.read(slot.name, lo, hi, arrays)
                for section, values in enumerate(arrays):
                    data = values.numpy().data.cast("B")
                    crcs[section] = zlib.crc32(data, crcs[section])
                    at = section_offset(total, section, slot.offset + lo)
                    while data:
                        written = os.pwrite(fd, data, at)
                        data, at = data[written:], at + written
                progress.update(hi - lo)
        os.ftruncate(fd, section_offset(total, 3, 0))
        os.fsync(fd)
    finally:
        progress.close()
        os.close(fd)
    os.replace(path.with_name(path.name + ".tmp"), path)
    write_atomically(partial / "rank0.extra.pt", lambda f: torch.save(extra, f))
    manifest = Manifest(
        world_size=1,
        stage=stage,
        dtype=dtype,
        step=int(extra["optimizer_steps"]),
        units=[UnitRecord(0, total, 1, slots)],
        ranks=[RankRecord(path.name, total, crcs)],
        aliases=dict(source.aliases),
    )
    write_atomically(partial / MANIFEST, lambda f: f.write(manifest.to_json().encode()))
    fsync_dir(partial)
    folder = commit_tag(root, tag)
    write_atomically(root / LATEST, lambda f: f.write(tag.encode()))
    fsync_dir(root)
    return folder


def import_deepspeed(
    directory: str | os.PathLike, out: str | os.PathLike, tag: str | None = None
) -> Path:
    """Convert the DeepSpeed checkpoint in ``directory`` (its save folder with ``latest``, a
    Trainer's ``checkpoint-N``, or the ``global_stepN`` folder; ``tag``: which one, default
    ``latest``) into this library's format under ``out``, with the DeepSpeed tag as its tag;
    returns the new checkpoint's folder."""
    from .deepspeed import DeepSpeedSource, find_deepspeed

    found = find_deepspeed(Path(directory), tag)
    if found is None:
        raise CheckpointError(
            f"{directory}: not a DeepSpeed checkpoint (no latest naming a folder of "
            "*_model_states.pt files, and no such files in it)"
        )
    source = DeepSpeedSource(found)
    try:
        half = {"bf16": "bfloat16", "fp16": "float16"}
        dtype = next(
            (d for k, d in half.items() if (source.config.get(k) or {}).get("enabled")),
            "float32",
        )
        return write_checkpoint(source, out, source.tag, source.stage, dtype)
    finally:
        source.close()
