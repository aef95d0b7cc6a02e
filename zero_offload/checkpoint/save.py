"""Save: every rank streams its optimizer tier into its own file; rank 0 commits.

Atomic at every step: ranks write into ``DIR/.<tag>.partial`` under temporary names, fsync and
rename; rank 0 writes the manifest last, makes the folder the tag's checkpoint (``tags``) and
only then moves ``latest``. A process killed at any point leaves a complete checkpoint under
every tag that had one, and ``latest`` naming one. State held on NVMe is streamed sub-group by
sub-group, never whole in memory.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import SwapIOError
from ..optim.policy import ADAM_STATE_BYTES
from ..params.units import persistent_buffers
from ..progress import Progress
from .checkpointable import Checkpointable
from .format import (
    MANIFEST,
    CheckpointError,
    Manifest,
    RankRecord,
    SlotRecord,
    UnitRecord,
    fsync_dir,
    native_file,
    policy_record,
    section_offset,
    write_atomically,
)
from .tags import LATEST, check_tag, commit_tag, recover_tag

__all__ = ["save_checkpoint", "unit_records"]

log = logging.getLogger(__name__)


def _crc_zeros(nbytes: int, crc: int) -> int:
    block = bytes(min(nbytes, 1 << 20))
    while nbytes > 0:
        crc = zlib.crc32(block[: min(nbytes, len(block))], crc)
        nbytes -= len(block)
    return crc


def _write_state(engine: Checkpointable, path: Path) -> RankRecord:
    """Stream [master | exp_avg | exp_avg_sq] into ``path``; CRC32 per section. Zero
    moments (frozen units) are not written: the file is sparse there and reads as zeros."""
    numel = engine.shard_numel
    crcs = [0, 0, 0]
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    progress = Progress(
        f"saving checkpoint {path.parent}",
        ADAM_STATE_BYTES * numel,
        "B",
        show=engine.comm.rank == 0,
        logger=log,
    )
    try:
        for lo, arrays in engine.state_chunks():
            length = arrays[0].numel()
            progress.update(ADAM_STATE_BYTES * length)
            for section, values in enumerate(arrays):
                if values is None:
                    crcs[section] = _crc_zeros(4 * length, crcs[section])
                    continue
                data = values.contiguous().numpy().data.cast("B")
                crcs[section] = zlib.crc32(data, crcs[section])
                offset = section_offset(numel, section, lo)
                while data:
                    written = os.pwrite(fd, data, offset)
                    data, offset = data[written:], offset + written
        os.ftruncate(fd, section_offset(numel, 3, 0))
        os.fsync(fd)
    finally:
        progress.close()
        os.close(fd)
    os.replace(tmp, path)
    return RankRecord(path.name, numel, crcs)


def _numpy_rng() -> tuple:
    """numpy's RNG state with its uint32 key array as an int64 tensor: plain data that
    ``torch.load(weights_only=True)`` reads back."""
    state = np.random.get_state(legacy=True)
    if not isinstance(state, tuple):  # a dict: np.random was given another bit generator
        raise CheckpointError(
            "save_checkpoint stores numpy's global RNG as MT19937 state, but "
            "np.random.set_bit_generator replaced it; set an MT19937 one back"
        )
    name, keys, pos, has_gauss, cached = state
    return name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached


def _extra_state(engine: Checkpointable, lr_scheduler: Any) -> dict:
    extra: dict[str, Any] = {
        **engine.training_state(),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": _numpy_rng(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
    }
    if engine.comm.rank == 0:
        extra["lr_scheduler"] = lr_scheduler.state_dict() if lr_scheduler is not None else None
    extra = _plain(extra)
    _check_plain(extra)
    if engine.comm.rank == 0:
        extra["buffers"] = {
            k: v.detach().cpu() for k, v in persistent_buffers(engine.module).items()
        }
    return extra


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (common in lr scheduler states) as Python numbers and
    tensors, which ``torch.load(weights_only=True)`` reads."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (
            type(value)(map(_plain, value))
            if type(value) in (list, tuple)
            else [_plain(v) for v in value]
        )
    return value


def _check_plain(extra: dict) -> None:
    """Refuse now what loading would refuse: state that is not tensors and plain data."""
    for key, value in extra.items():
        if key == "buffers":  # tensors by construction
            continue
        data = io.BytesIO()
        torch.save(value, data)
        data.seek(0)
        try:
            torch.load(data, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"save_checkpoint: the {key} state holds objects other than tensors and plain "
                f"data, which a checkpoint does not store (loading them could run code); "
                f"keep such state out of state_dict(): {str(exc).strip().splitlines()[-1]}"
            ) from exc


def unit_records(engine: Checkpointable) -> list[UnitRecord]:
    """The engine's units as the manifest records them."""
    return [
        UnitRecord(
            u.shard_offset,
            u.layout.padded_numel,
            u.layout.num_shards,
            [SlotRecord(s.name, list(s.shape), s.offset, s.numel) for s in u.layout.slots],
        )
        for u in engine.units
    ]


def _manifest(engine: Checkpointable, ranks: list[RankRecord]) -> Manifest:
    units = unit_records(engine)
    stored = {id(p): name for u in engine.units for p, name in zip(u.params, u.names)}
    aliases = {
        name: stored[id(p)]
        for name, p in engine.module.named_parameters(remove_duplicate=False)
        if stored[id(p)] != name
    }
    return Manifest(
        engine.comm.world_size,
        engine.stage,
        str(engine.dtype).removeprefix("torch."),
        engine.optimizer_steps,
        units,
        ranks,
        aliases,
        policy_record(engine.state_policy),
    )


def save_checkpoint(
    engine: Checkpointable,
    directory: str | os.PathLike,
    tag: str | None = None,
    lr_scheduler: Any = None,
) -> Path:
    """Write this rank's shards and (rank 0) the manifest; returns ``DIR/<tag>``.
    Collective: every rank must call it."""
    comm = engine.comm
    root = Path(directory)
    tag = check_tag(f"step{engine.global_steps}" if tag is None else tag)
    extra = _extra_state(engine, lr_scheduler)  # checked before anything is written
    partial = root / f".{tag}.partial"
    if comm.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        recover_tag(root, tag)  # what a stopped save left behind
        partial.mkdir()
    comm.barrier()
    rank = comm.rank
    with _disk_errors(root, tag, partial / f"rank{rank}.state"):
        record = _write_state(engine, partial / f"rank{rank}.state")
        write_atomically(partial / f"rank{rank}.extra.pt", lambda f: torch.save(extra, f))
        native = engine.native_state()
        if native is not None:  # views of larger storages are saved as themselves only
            native = {
                k: t if t.untyped_storage().nbytes() == t.nbytes else t.clone()
                for k, t in native.items()
            }
            write_atomically(partial / native_file(rank), lambda f: torch.save(native, f))
    records = comm.all_gather_object(record)
    if rank == 0:
        manifest = _manifest(engine, records)
        with _disk_errors(root, tag, partial / MANIFEST):
            write_atomically(partial / MANIFEST, lambda f: f.write(manifest.to_json().encode()))
            fsync_dir(partial)
            commit_tag(root, tag)
            write_atomically(root / LATEST, lambda f: f.write(tag.encode()))
            fsync_dir(root)
    comm.barrier()
    return root / tag


@contextlib.contextmanager
def _disk_errors(root: Path, tag: str, where: Path) -> Iterator[None]:
    """A write that fails (a full disk) is a CheckpointError naming the file; what ``latest``
    names is untouched (the next save removes the partial folder)."""
    try:
        yield
    except SwapIOError:
        raise  # reading the swapped state: it names its file already
    except OSError as err:
        raise CheckpointError(
            f"saving checkpoint {tag!r} in {root} failed writing {err.filename or where}: "
            f"{err.strerror or err}; the checkpoint 'latest' names is unchanged. Free space "
            "(or pick another folder) and save again"
        ) from err
