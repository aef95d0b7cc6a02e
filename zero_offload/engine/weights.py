"""Pretrained weights from safetensors files, read one tensor at a time.

Accepts what Hugging Face writes: a folder with ``model.safetensors.index.json`` (the
``weight_map`` names each tensor's shard file), a folder of ``*.safetensors`` files, or one
file. Only headers are read up front (names, shapes); each tensor is read when its unit is
built, so a model larger than host memory loads without ever being whole in it. safetensors
is a dependency because its lazy, memory-mapped reads are exactly this job.

Module buffers (BatchNorm running statistics and the like) follow rank 0 as with
``DistributedDataParallel``: copied to every rank at ``initialize`` and before each training
forward (``broadcast_buffers=True``), one collective per dtype (:func:`broadcast_buffers`);
exports read rank 0's values (:func:`rank0_values`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open

from ..comm import Comm
from ..config import ConfigError
from ..params.units import UnitPlan, persistent_buffers
from ..partition import mismatch_message

__all__ = [
    "PretrainedWeights",
    "broadcast_buffers",
    "load_buffers",
    "open_pretrained",
    "rank0_values",
]

INDEX = "model.safetensors.index.json"


class PretrainedWeights:
    def __init__(self, path: str | os.PathLike) -> None:
        root = Path(path)
        if root.is_dir():
            index = root / INDEX
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {name: root / f for name, f in weight_map.items()}
            else:
                shards = sorted(root.glob("*.safetensors"))
                if not shards:
                    raise ConfigError(
                        f"init_weights={str(root)!r}: no {INDEX} and no "
                        "*.safetensors files in that folder"
                    )
                files = {name: shard for shard in shards for name in self._names(shard)}
        elif root.is_file():
            files = {name: root for name in self._names(root)}
        else:
            raise ConfigError(f"init_weights={str(root)!r}: no such file or folder")
        self.path = root
        self._file = files
        self._handles: dict[Path, Any] = {}
        self.shapes = {
            name: tuple(self._open(f).get_slice(name).get_shape()) for name, f in files.items()
        }

    @staticmethod
    def _names(path: Path) -> list[str]:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())

    def _open(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (OSError, Exception) as exc:  # safetensors raises its own error types
                raise ConfigError(f"init_weights: cannot read {path}: {exc}") from exc
        return self._handles[path]

    def resolve(
        self,
        expected: dict[str, tuple[int, ...]],
        aliases: dict[str, list[str]],
        buffers: dict[str, tuple[int, ...]] | None = None,
    ) -> dict[str, str]:
        """Map each model parameter (and persistent buffer) name to the stored name that holds
        it (itself, or a tied alias); raise one error listing every missing, unexpected or
        mis-shaped tensor. Buffers may be missing (the model keeps its own values: many files
        hold parameters only); a file that has them — any ``model.state_dict()`` saved, or
        what ``consolidate_checkpoint`` writes — loads them."""
        chosen: dict[str, str] = {}
        missing, shapes = [], []
        buffers = buffers or {}
        for name, shape in {**expected, **buffers}.items():
            stored = next((n for n in [name, *aliases.get(name, [])] if n in self.shapes), None)
            if stored is None:
                if name not in buffers:
                    missing.append(name)
            elif self.shapes[stored] != tuple(shape):
                shapes.append(f"{stored}: file {self.shapes[stored]}, model {tuple(shape)}")
            else:
                chosen[name] = stored
        known = set(expected) | set(buffers) | {a for names in aliases.values() for a in names}
        unexpected = set(self.shapes) - known
        problem = mismatch_message("file", missing, unexpected, shapes)
        if problem:
            raise ConfigError(f"init_weights={str(self.path)!r} {problem}")
        return chosen

    def load(self, stored_name: str) -> torch.Tensor:
        """One tensor, read now (as stored; the caller converts)."""
        return self._open(self._file[stored_name]).get_tensor(stored_name)

    def close(self) -> None:
        self._handles.clear()


def open_pretrained(
    path: str | os.PathLike, model: nn.Module, plans: list[UnitPlan]
) -> tuple[PretrainedWeights, dict[str, str]]:
    """Open the file and check it against the model's parameters (by their units' names, tied
    aliases accepted) and persistent buffers before any memory is allocated; returns the
    weights and, per model name, the stored name to read."""
    weights = PretrainedWeights(path)
    canonical = {id(p): n for plan in plans for n, p in zip(plan.names, plan.params)}
    aliases: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if canonical[id(p)] != name:
            aliases.setdefault(canonical[id(p)], []).append(name)
    expected = {n: tuple(p.shape) for plan in plans for n, p in zip(plan.names, plan.params)}
    buffers = {n: tuple(b.shape) for n, b in persistent_buffers(model).items()}
    return weights, weights.resolve(expected, aliases, buffers)


def load_buffers(model: nn.Module, weights: PretrainedWeights, stored: dict[str, str]) -> None:
    """Copy the persistent buffers the file holds into the model (it keeps its own otherwise)."""
    with torch.no_grad():
        for name, b in persistent_buffers(model).items():
            if name in stored:
                b.copy_(weights.load(stored[name]))


def _by_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def rank0_values(tensors: list[torch.Tensor], comm: Comm) -> list[torch.Tensor]:
    """Rank 0's values of ``tensors`` (the same list on every rank), as new tensors."""
    if comm.world_size == 1:
        return [t.detach().clone() for t in tensors]
    out: dict[int, torch.Tensor] = {}
    for group in _by_dtype(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src=0)
        offset = 0
        for t in group:
            out[id(t)] = flat[offset : offset + t.numel()].view(t.shape).clone()
            offset += t.numel()
    return [out[id(t)] for t in tensors]


def broadcast_buffers(model: nn.Module, comm: Comm) -> None:
    """Every buffer of ``model`` takes rank 0's value, in place. Collective."""
    if comm.world_size == 1:
        return
    buffers = [b for b in model.buffers() if b.numel()]
    with torch.no_grad():
        for b, value in zip(buffers, rank0_values(buffers, comm)):
            b.copy_(value)
