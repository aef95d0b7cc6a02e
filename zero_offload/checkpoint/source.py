"""Where a resume reads its state from: this library's checkpoints, DeepSpeed's, or DCP folders.

A :class:`Source` offers the stored parameters by name (shapes, tied names), any element range
of each one's fp32 master, ``exp_avg`` and ``exp_avg_sq``, and the counters and hyperparameters
a resume needs in the layout of this library's extra files (``save._extra_state``). The
loader (``load``) and the importer (``convert``) need nothing else, so each foreign format is
one reader beside this file, and loading any of them at any world size and stage is the same
loop over the engine's units.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from ..optim.policy import StatePolicy
from ..partition import mismatch_message
from .format import CheckpointError, Manifest, load_plain, pieces, read_manifest, section_offset

__all__ = ["Source", "OwnSource", "match_names", "one_param_group"]


class Source(Protocol):
    """A stored checkpoint, read piece by piece."""

    where: Path  # named in every error
    tag: str  # what load_checkpoint returns
    shapes: dict[str, tuple[int, ...]]  # every stored parameter, frozen ones too
    aliases: dict[str, str]  # tied name -> stored name
    optional: set[str]  # stored names the model need not have (DCP: buffers or frozen)
    policy: StatePolicy  # the optimizer kind and precisions the state was kept in

    def read(self, name: str, start: int, end: int, out: Sequence[torch.Tensor | None]) -> None:
        """Elements [start, end) of the flattened parameter ``name``: master, exp_avg and
        exp_avg_sq into ``out[0..2]`` (fp32, ``end - start`` each; None: not wanted). A
        frozen parameter writes only ``out[0]`` (it has no moments)."""

    def extra(self, rank: int) -> tuple[dict[str, Any], bool]:
        """The extra state for ``rank`` (``save._extra_state``'s keys; ``rng`` optional) and
        whether it is that rank's own (RNG streams are restored only then)."""

    def close(self) -> None: ...


def match_names(
    source: Source, engine_names: dict[str, tuple[int, ...]], engine_aliases: dict[str, list[str]]
) -> dict[str, str]:
    """Engine parameter name -> stored name. A tied parameter may be stored under any of its
    names (``engine_aliases``: stored name -> its other names); the rest must match exactly,
    shapes included, or the error lists every difference."""
    known = {**{n: n for n in source.shapes}, **source.aliases}
    mapping, missing = {}, []
    for name in engine_names:
        found = next((known[n] for n in (name, *engine_aliases.get(name, ())) if n in known), None)
        if found is None:
            missing.append(name)
        else:
            mapping[name] = found
    unexpected = set(source.shapes) - set(mapping.values()) - source.optional
    shapes = [
        f"{n}: stored {source.shapes[s]}, model {engine_names[n]}"
        for n, s in mapping.items()
        if tuple(source.shapes[s]) != tuple(engine_names[n])
    ]
    problem = mismatch_message("checkpoint", missing, unexpected, shapes)
    if problem:
        raise CheckpointError(f"{source.where}: {problem}")
    return mapping


def one_param_group(groups: list[dict[str, Any]], where: Path) -> list[dict[str, Any]]:
    """The engine's one param group from another optimizer's groups (Trainer's decay and
    no-decay groups, say): lr, betas and eps must be the same in all, since the engine steps
    every parameter with one; weight decay is the groups' nonzero value (the groups with
    none are the no-decay ones, which the engine takes from its ``no_decay`` keyword)."""
    if not groups:
        return []
    out: dict[str, Any] = {}
    for key in ("lr", "betas", "eps"):
        values = {_number(g.get(key)) for g in groups}
        if len(values) > 1:
            raise CheckpointError(
                f"{where}: the saved param groups have different {key} ({sorted(values)}); "
                f"the engine steps all parameters with one {key}"
            )
        value = values.pop()
        if value is not None:
            out[key] = value
    decays = {float(g["weight_decay"]) for g in groups if g.get("weight_decay")}
    if len(decays) > 1:
        raise CheckpointError(
            f"{where}: the saved param groups decay by {sorted(decays)}; the engine has one "
            "weight decay (and no_decay for the parameters without)"
        )
    out["weight_decay"] = decays.pop() if decays else 0.0
    return [out]


def _number(value: Any) -> Any:
    """A hyperparameter as plain floats (a tensor lr, a list of betas)."""
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    return None if value is None else float(value)


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


class OwnSource:
    """A checkpoint this library wrote (``format``): one folder of rank files and a manifest."""

    def __init__(self, folder: Path, tag: str | None = None) -> None:
        self.where, self.tag = folder, tag or folder.name
        self.manifest = read_manifest(folder)
        self._slots = self.manifest.slots_by_name()
        self.shapes = {n: tuple(slot.shape) for n, (_, slot) in self._slots.items()}
        self.aliases = dict(self.manifest.aliases)
        self.optional: set[str] = set()
        self.policy = self.manifest.policy
        self.reader = _Reader(folder, self.manifest)

    def read(self, name: str, start: int, end: int, out: Sequence[torch.Tensor | None]) -> None:
        unit, slot = self._slots[name]
        for rank, element, count, at in pieces(unit, slot, start, end):
            for section, array in enumerate(out):
                if array is not None:
                    self.reader.read(rank, section, element, array[at : at + count])

    def extra(self, rank: int) -> tuple[dict[str, Any], bool]:
        own = self.where / f"rank{rank}.extra.pt"
        first = self.where / "rank0.extra.pt"
        extra = load_plain(own if own.exists() else first)
        if own.exists() and rank != 0:  # rank 0's file alone has the shared state
            shared = load_plain(first)
            extra.update({k: shared[k] for k in ("lr_scheduler", "buffers") if k in shared})
        return extra, own.exists()

    def close(self) -> None:
        self.reader.close()
