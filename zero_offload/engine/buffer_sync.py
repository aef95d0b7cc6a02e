"""Module buffers (BatchNorm running statistics and the like) kept equal on every rank.

Each rank's forward updates its buffers from its own micro-batch, so they drift apart. As
``DistributedDataParallel`` does, the engine copies rank 0's buffers to every rank at
``initialize`` and before each training forward (``broadcast_buffers=True``), in one
collective per dtype. Exports read rank 0's values, so every rank writes the same ones.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm

__all__ = ["broadcast_buffers", "rank0_values"]


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
