"""How big the NVMe parameter pool is and which units keep their shards in host memory: the
rules :class:`~.store.ParamStore` and ``estimate_memory`` share, so that the estimate counts
what the engine allocates."""

from __future__ import annotations

import bisect

import torch

from ..config import ZeroConfig
from ..policies import Tier
from ..swap.buffers import pool_footprint

__all__ = [
    "WRITE_BACK_BUFFERS",
    "param_host_numel",
    "param_pool_buffers",
    "param_pool_bytes",
    "shards_in_host_memory",
    "units_per_sub_group",
]


WRITE_BACK_BUFFERS = 4
"""The fewest pool buffers for an update's write-backs beside the passes (``overlap_step``,
``step_during_backward``): each new shard stays in its buffer as the unit's read ahead until
the forward gathers it. Without them those buffers leave fewer than two free, and the forward
starts no reads ahead (``prefetch``) and waits on the disk for most of its gathers."""


def param_pool_buffers(
    prefetch_depth: int, optimizer_on_nvme: bool, units_per_group: int = 0
) -> int:
    """Host buffers the NVMe parameter pool wants: one per read ahead, the one being
    gathered, one for a write-back after the step, and, where the optimizer state is on NVMe
    (only that update runs beside the passes), one per unit whose new shard one optimizer
    sub-group's step puts (``units_per_group``, :func:`units_per_sub_group`), at least
    :data:`WRITE_BACK_BUFFERS`. A step puts them all at once and each stays as the unit's
    read ahead until the forward gathers it.

    With 4 at 99M (10 units a sub-group, a block's modules), a step's put waited for the
    write of the buffer it took from a read ahead: 0.3 s of each forward's 1.3 s with half
    the state in files; 0.02 s of a 0.9 s forward with 10. Decided by the tiers and the
    units alone, so that the estimate and the engine agree: with ``overlap_step`` and
    ``step_during_backward`` both off those buffers go unused."""
    write_backs = max(WRITE_BACK_BUFFERS, units_per_group)
    return prefetch_depth + 2 + (write_backs if optimizer_on_nvme else 0)


def units_per_sub_group(shards: list[tuple[int, int]], group: int) -> int:
    """The most units whose shards, each (shard_offset, shard_numel) of the rank-flat order,
    meet one sub-group of ``group`` elements (the optimizer's, from the shard's start)."""
    spans = sorted((offset, offset + numel) for offset, numel in shards if numel > 0)
    if not spans or group <= 0:
        return 0
    starts, ends = [a for a, _ in spans], [b for _, b in spans]
    return max(
        bisect.bisect_left(starts, lo + group) - bisect.bisect_right(ends, lo)
        for lo in range(0, ends[-1], group)
    )


def shards_in_host_memory(param_tier: Tier, device_type: str) -> bool:
    """Whether stage 3's whole-shard buffer (``ParamStore.resident``) is host memory, where the
    CPU Adam writes its new values straight in: offloaded to the CPU, or a CPU device. NVMe
    shards have no such buffer."""
    return param_tier.on_host or (not param_tier.offloaded and device_type == "cpu")


def param_host_numel(shards: list[tuple[int, int]], fraction: float | None) -> int:
    """Rank-flat elements of the leading units whose shards stay in host memory, given each
    unit's (shard_offset, shard_numel) and the share in files (None: all in files): the unit
    boundary nearest to ``1 - fraction`` of the shard."""
    if fraction is None or not shards:
        return 0
    ends = sorted(offset + numel for offset, numel in shards)
    target = (1.0 - fraction) * ends[-1]
    return min([0, *ends], key=lambda end: abs(end - target))


def param_pool_bytes(
    cfg: ZeroConfig, largest_shard: int, dtype: torch.dtype, units_per_group: int = 0
) -> int:
    """Host bytes the NVMe parameter pool wants (0 off NVMe): :func:`param_pool_buffers` of
    the largest unit's shard, as the pool rounds them; its share of the host budget."""
    if not cfg.offload.param_tier.on_nvme or largest_shard <= 0:
        return 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    buffers = param_pool_buffers(
        cfg.prefetch_depth, cfg.offload.optimizer_tier.on_nvme, units_per_group
    )
    return buffers * pool_footprint(largest_shard * itemsize)
