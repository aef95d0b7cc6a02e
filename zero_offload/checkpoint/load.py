"""Load: every rank rebuilds its own shards, unit by unit, from whichever stored ranks hold
those elements — so a checkpoint saved on N ranks loads on M ranks, in any stage.

The folder may be this library's checkpoint, a DeepSpeed ZeRO checkpoint (``deepspeed``) or a
``torch.distributed.checkpoint`` folder (``dcp``): each is a :class:`~.source.Source`, and the
rest is the same. Nothing is used before it is checked: the parameter names and shapes, and
(this library's format) the manifest's version and each stored file's size and checksums (the
ranks split that work). The state then streams one unit at a time into the optimizer's tier
(device, host or NVMe) and the compute-dtype parameters are recomputed from the master.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..params.units import persistent_buffers
from ..progress import Progress
from . import dcp, deepspeed
from .checkpointable import Checkpointable
from .format import CheckpointError, Manifest, load_plain, native_file, verify_rank_file
from .save import unit_records
from .source import OwnSource, Source, match_names
from .tags import resolve_tag, tag_folder

__all__ = ["load_checkpoint", "open_source"]

log = logging.getLogger(__name__)


def _verify(engine: Checkpointable, folder: Path, manifest: Manifest) -> None:
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


def open_source(directory: str | os.PathLike, tag: str | None = None) -> Source:
    """The checkpoint in ``directory``: a DeepSpeed one (``latest`` naming a folder of
    ``*_model_states.pt``, or that folder), a DCP folder (``.metadata``), or this library's
    (``tag`` or ``latest``)."""
    root = Path(directory)
    found = deepspeed.find_deepspeed(root, tag)
    if found is not None:
        return deepspeed.DeepSpeedSource(found)
    if dcp.is_dcp(root):
        return dcp.DcpSource(root)
    tag = resolve_tag(root, tag)
    return OwnSource(tag_folder(root, tag), tag)


def _set_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]  # keys: a tensor (an array before)
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _restore_extra(
    engine: Checkpointable, source: Source, extra: dict[str, Any], own: bool, lr_scheduler: Any
) -> None:
    engine.load_training_state(extra)
    if (
        own and extra.get("rng") is not None
    ):  # RNG streams belong to a rank; a new one keeps its own
        _set_rng(extra["rng"])
    if lr_scheduler is not None and extra.get("lr_scheduler") is None:
        log.warning(
            "%s has no lr scheduler state: %s is left as it is. A scheduler the loop steps "
            "itself is saved only when passed to save_checkpoint; hand it to the engine "
            "(engine.lr_scheduler = sched, stepped after each update) and every checkpoint "
            "carries it, save_on_preemption's too",
            source.where,
            type(lr_scheduler).__name__,
        )
    elif lr_scheduler is not None:
        try:
            lr_scheduler.load_state_dict(extra["lr_scheduler"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{source.where}: the stored lr scheduler state does not fit "
                f"{type(lr_scheduler).__name__} ({exc}); build the scheduler the run used, or "
                "pass lr_scheduler=None and set it up yourself"
            ) from exc
    stored = extra.get("buffers", {})  # a DCP folder's are read one by one, when asked for
    for name, buffer in persistent_buffers(engine.module).items():
        if name in stored:
            buffer.copy_(stored[name])


def _tied_names(engine: Checkpointable) -> dict[str, list[str]]:
    """Stored name -> the other names of the same (tied) parameter."""
    stored = {id(p): name for u in engine.units for p, name in zip(u.params, u.names)}
    out: dict[str, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if stored[id(p)] != name:
            out.setdefault(stored[id(p)], []).append(name)
    return out


def _check_policy(engine: Checkpointable, source: Source, convert_state: bool) -> bool:
    """Whether the stored native state restores as it is (same policy, world size and
    units); a policy other than the engine's raises unless ``convert_state``."""
    saved = source.policy
    want = engine.state_policy
    if saved != want and not convert_state:
        raise CheckpointError(
            f"{source.where}: the optimizer state was saved as {saved.describe()}, this "
            f"engine keeps {want.describe()}; build the engine with optimizer_type="
            f"{saved.kind.value!r}, moment_precision={saved.moments.value!r}, "
            f"master_precision={saved.master.value!r}"
            + (
                f", fp32_moment_params={sorted(saved.fp32_moments)!r}"
                if saved.fp32_moments != want.fp32_moments
                else ""
            )
            + " to resume as saved, or pass "
            "convert_state=True to load_checkpoint to convert it through fp32"
        )
    exact = (
        isinstance(source, OwnSource)
        and saved == want
        and not want.is_default
        and source.manifest.world_size == engine.comm.world_size
        and source.manifest.units == unit_records(engine)
    )
    if not want.is_default and not exact or saved != want:
        log.info(
            "load_checkpoint: optimizer state saved as %s (world size %s) loaded as %s "
            "(world size %d) through fp32: 8-bit moments requantized (within one "
            "quantization step), a bf16 master rounded",
            saved.describe(),
            getattr(getattr(source, "manifest", None), "world_size", "?"),
            want.describe(),
            engine.comm.world_size,
        )
    return exact


def restore(
    engine: Checkpointable, source: Source, lr_scheduler: Any = None, convert_state: bool = False
) -> None:
    """Fill every unit of ``engine`` from ``source``, then the counters. Collective."""
    exact = _check_policy(engine, source, convert_state)
    names = match_names(
        source,
        {n: tuple(s.shape) for u in engine.units for n, s in zip(u.names, u.layout.slots)},
        _tied_names(engine),
    )
    if isinstance(source, OwnSource):  # sizes and checksums before any use
        _verify(engine, source.where, source.manifest)
    rank = engine.comm.rank
    extra, own = source.extra(rank)  # read (and refused, if it must be) before any write
    progress = Progress(
        f"loading checkpoint {source.where}",
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
                dst = slice(o.shard_start, o.shard_start + o.slot_end - o.slot_start)
                name = names[unit.layout.slots[o.slot].name]
                source.read(name, o.slot_start, o.slot_end, [a[dst] for a in arrays])
            engine.load_unit_state(unit, *arrays)
            progress.update(unit.shard_numel)
        if exact:  # the state as the saving run kept it, bit for bit
            assert isinstance(source, OwnSource)
            engine.load_native_state(load_plain(source.where / native_file(rank)))
        engine.finish_load()
    finally:
        progress.close()
    _restore_extra(engine, source, extra, own, lr_scheduler)


def load_checkpoint(
    engine: Checkpointable,
    directory: str | os.PathLike,
    tag: str | None = None,
    lr_scheduler: Any = None,
    convert_state: bool = False,
) -> str:
    """Restore params, optimizer state, step counts, loss scaler and RNG; returns the tag
    (a DeepSpeed checkpoint's folder name, or the DCP folder's name). Collective: every rank
    must call it. ``convert_state``: load optimizer state saved with another kind or
    precision (``optimizer_type``, ``moment_precision``, ``master_precision``) through fp32;
    without it that is a :class:`CheckpointError`."""
    source = open_source(directory, tag)
    try:
        restore(engine, source, lr_scheduler, convert_state)
    finally:
        source.close()
    return source.tag
