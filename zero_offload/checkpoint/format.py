"""The checkpoint format: one folder per tag, a state file per rank, a manifest written last.

    DIR/latest                 the tag of the last complete checkpoint (replaced atomically;
                               ``tags`` says how a tag is taken over)
    DIR/<tag>/manifest.json    format version, world size, stage, dtypes, the unit layouts
                               (original parameter names, shapes, offsets), per-rank checksums
    DIR/<tag>/rank<r>.state    rank r's flat fp32 shards: [master | exp_avg | exp_avg_sq],
                               each ``numel`` elements, little-endian
    DIR/<tag>/rank<r>.native.pt  an optimizer-state policy other than fp32 AdamW: rank r's
                               state as the optimizer keeps it (8-bit codes, absmax and side
                               arrays, a bf16 master and its compensation), by array name;
                               the sections above then hold it as fp32 (the master with its
                               compensation added, each moment dequantized: Lion's momentum
                               as exp_avg, Adagrad's sum as exp_avg_sq)
    DIR/<tag>/rank<r>.extra.pt step counts, loss scaler, RNG states, hyperparameters,
                               (rank 0) lr scheduler state and module buffers: tensors and
                               plain data only, read with ``torch.load(weights_only=True)``

The low-precision parameters are not stored: they are always the round-to-nearest cast of the
fp32 master, and loading recomputes them. A resume at the saving world size, stage and policy
restores the native state bit for bit; any other load reads the fp32 sections. Names and
offsets in the manifest let any world size and stage read any other's files, and let
consolidation build one state dict without a converter and without the optimizer state.
"""

from __future__ import annotations

import importlib
import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..errors import CheckpointError
from ..optim.policy import StatePolicy
from ..partition import split_range

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "SlotRecord",
    "UnitRecord",
    "RankRecord",
    "Manifest",
    "read_manifest",
    "pieces",
    "verify_rank_file",
    "write_atomically",
    "fsync_dir",
    "SECTIONS",
    "load_plain",
    "refusal_reason",
    "native_file",
    "policy_record",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SECTIONS = ("master", "exp_avg", "exp_avg_sq")
_FP32 = 4


@dataclass
class SlotRecord:
    name: str
    shape: list[int]
    offset: int
    numel: int


@dataclass
class UnitRecord:
    shard_offset: int
    padded_numel: int
    num_shards: int
    slots: list[SlotRecord]

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards


@dataclass
class RankRecord:
    file: str
    numel: int
    crc32: list[int]  # one per section


@dataclass
class Manifest:
    world_size: int
    stage: int
    dtype: str
    step: int
    units: list[UnitRecord]
    ranks: list[RankRecord]
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> stored name
    optimizer: dict[str, Any] | None = None  # the StatePolicy's values; None: fp32 AdamW
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, path: Path) -> "Manifest":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not a valid manifest ({exc})") from exc
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: checkpoint format version {version!r}, this zero_offload reads "
                f"version {FORMAT_VERSION}; use the zero_offload release that wrote it"
            )
        try:
            raw["units"] = [
                UnitRecord(**{**u, "slots": [SlotRecord(**s) for s in u["slots"]]})
                for u in raw["units"]
            ]
            raw["ranks"] = [RankRecord(**r) for r in raw["ranks"]]
            return cls(**raw)
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: manifest is missing or has bad fields ({exc})") from exc

    @property
    def policy(self) -> StatePolicy:
        """The optimizer kind and state precisions the checkpoint was saved with."""
        if self.optimizer is None:
            return StatePolicy()
        o = self.optimizer
        return StatePolicy.parse(o["kind"], o["moments"], o["master"], o.get("fp32_moments", ()))

    def slots_by_name(self) -> dict[str, tuple[UnitRecord, SlotRecord]]:
        return {s.name: (u, s) for u in self.units for s in u.slots}


def policy_record(policy: StatePolicy) -> dict[str, Any]:
    record: dict[str, Any] = {
        "kind": policy.kind.value,
        "moments": policy.moments.value,
        "master": policy.master.value,
    }
    if policy.fp32_moments:
        record["fp32_moments"] = sorted(policy.fp32_moments)
    return record


def native_file(rank: int) -> str:
    """The file of rank ``rank``'s optimizer state as stored (see the module's table)."""
    return f"rank{rank}.native.pt"


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)") from exc
    return Manifest.from_json(text, path)


def pieces(
    unit: UnitRecord, slot: SlotRecord, start: int, end: int
) -> list[tuple[int, int, int, int]]:
    """Where elements [start, end) of a stored parameter are: (rank, element offset in that
    rank's flat shard, count, offset inside [start, end))."""
    lo, hi = slot.offset + start, slot.offset + end
    if unit.num_shards == 1:  # stage 0: every rank holds the whole unit; read rank 0's
        return [(0, unit.shard_offset + lo, hi - lo, 0)]
    size = unit.shard_numel
    return [
        (shard, unit.shard_offset + a - shard * size, b - a, a - lo)
        for shard, a, b in split_range(lo, hi, size)
    ]


def section_offset(numel: int, section: int, element: int) -> int:
    """Byte offset of ``element`` of ``section`` in a rank file of ``numel`` per section."""
    return (section * numel + element) * _FP32


def verify_rank_file(path: Path, record: RankRecord, chunk: int = 1 << 26) -> None:
    """Size and per-section CRC32 against the manifest, streamed in ``chunk`` bytes."""
    expected = 3 * record.numel * _FP32
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    if size != expected:
        raise CheckpointError(
            f"{path}: {size} bytes, the manifest says {expected} (truncated "
            "or from another checkpoint)"
        )
    with open(path, "rb") as f:
        for section, want in enumerate(record.crc32):
            crc, left = 0, record.numel * _FP32
            while left:
                data = f.read(min(chunk, left))
                if not data:
                    raise CheckpointError(f"{path}: ends early")
                crc = zlib.crc32(data, crc)
                left -= len(data)
            if crc != want:
                raise CheckpointError(
                    f"{path}: checksum mismatch in the {SECTIONS[section]} "
                    "section (the file is damaged)"
                )


def _numpy_rng_types() -> list[Any]:
    """What the numpy RNG state (an uint32 array) of older extra files needs unpickled: array
    reconstruction and dtypes, under numpy 1's and numpy 2's module names. None runs code."""
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")  # numpy >= 2
    except ImportError:
        multiarray = importlib.import_module("numpy.core.multiarray")
    rebuild = multiarray._reconstruct
    return [
        rebuild,
        (rebuild, "numpy.core.multiarray._reconstruct"),
        (rebuild, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def refusal_reason(exc: BaseException) -> str:
    """The line of a ``torch.load(weights_only=True)`` error that names what it refused (the
    global), else its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "global" in line.lower() or "unpickler" in line.lower()]
    return (named or lines or [type(exc).__name__])[0]


def load_plain(path: Path) -> dict[str, Any]:
    """A ``.pt`` file of tensors and plain data (``torch.load(weights_only=True)``). A file
    holding anything else is refused: unpickling it could run code from whoever made it."""
    try:
        with torch.serialization.safe_globals(_numpy_rng_types()):
            loaded = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except Exception as exc:
        raise CheckpointError(
            f"{path}: refused, it is not a file of tensors and plain data (loading it could "
            f"run code from the file; re-save it with zero_offload): {refusal_reason(exc)}"
        ) from exc
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: holds a {type(loaded).__name__}, not a dict")
    return loaded


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Any) -> None:
    """``write(f)`` into a temporary file beside ``path``, fsync, then rename over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    f: BinaryIO
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
