"""Checkpoints converted without an engine.

Import: a DeepSpeed ZeRO checkpoint (any :class:`~.source.Source` that knows which tensors
are parameters) written as this library's checkpoint format, which then loads at any world
size and stage and consolidates without DeepSpeed's reader. (A DCP folder cannot say which of
its tensors are frozen parameters and which buffers without the model: load it with
``engine.load_checkpoint``, which has the model.)

The output is one rank file holding every parameter end to end (one unit, one shard), written
in pieces of at most ``chunk`` elements per section: memory is three such pieces whatever the
model's size. The same atomic protocol as ``save``: a ``.<tag>.partial`` folder, the manifest
last, then the tag and ``latest``.

Consolidate: one ordinary full-precision state dict from a checkpoint of this library, no
converter needed. It reads only the master section of each rank file, straight into the output
tensors, one parameter at a time: memory is one fp32 copy of the parameters (what the output
is) and nothing of the optimizer state.
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
    policy_record,
    section_offset,
    verify_rank_file,
    write_atomically,
)
from .source import OwnSource, Source
from .tags import (
    LATEST,
    check_tag,
    checkpoint_root,
    commit_tag,
    recover_tag,
    resolve_tag,
    tag_folder,
)

__all__ = ["write_checkpoint", "import_deepspeed", "consolidate_checkpoint"]

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
        optimizer=policy_record(source.policy),
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


def _save(state: dict[str, torch.Tensor], aliases: dict[str, str], out: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        full = dict(state)
        full.update({alias: state[name] for alias, name in aliases.items()})
        torch.save(full, out)  # shared storage for tied names, as torch.save keeps it
        return
    # safetensors stores no shared tensors: tied names go in the metadata instead
    save_file(state, str(out), metadata={f"alias:{a}": n for a, n in aliases.items()})


def consolidate_checkpoint(
    directory: str | os.PathLike,
    tag: str | None = None,
    out: str | os.PathLike | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (and module buffers) under their original names. With ``out``,
    also written there: safetensors when installed (tied names in its metadata), else
    ``torch.save``. ``verify``: check every rank file's size and checksums first.
    ``directory``: the folder given to ``save_checkpoint``, or a Hugging Face Trainer
    checkpoint folder holding one (``checkpoint-N``), or the Trainer's ``output_dir`` (its
    newest ``checkpoint-N``)."""
    root = checkpoint_root(Path(directory))
    source = OwnSource(tag_folder(root, resolve_tag(root, tag)))
    manifest = source.manifest
    state: dict[str, torch.Tensor] = {}
    try:
        if verify:
            for record in manifest.ranks:
                verify_rank_file(source.where / record.file, record)
        progress = Progress(
            f"consolidating checkpoint {source.where}",
            sum(slot.numel for unit in manifest.units for slot in unit.slots),
            "parameters",
            logger=log,
        )
        try:
            for unit in manifest.units:
                for slot in unit.slots:
                    tensor = torch.empty(slot.numel, dtype=torch.float32)
                    source.read(slot.name, 0, slot.numel, [tensor, None, None])
                    state[slot.name] = tensor.view(slot.shape)
                    progress.update(slot.numel)
        finally:
            progress.close()
        state.update(source.extra(0)[0].get("buffers", {}))
    finally:
        source.close()
    if out is not None:
        _save(state, manifest.aliases, Path(out))
    state.update({alias: state[name] for alias, name in manifest.aliases.items()})
    return state
