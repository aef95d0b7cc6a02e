"""One host-memory budget per rank, shared by all of its pools and staging buffers.

Host RAM, not accelerator memory, is what ends offload runs in practice, and it is a node
resource: every rank on the node draws on the same RAM. So the budget is decided once per
rank, here, and every consumer of the rank (the NVMe parameter pool, the NVMe optimizer's
pipeline buffers and its output staging, the fp32 gradient shard or, when that does not fit,
the gradient swap buffers) takes its share of this one number. The engine and the planner
(``estimate_memory``) both call :func:`host_memory_budget` and :func:`split_host_budget`, so
what the planner predicts is what the engine does.

Default: ``DEFAULT_HOST_FRACTION`` of the node's available memory (``psutil``) when the rank
starts, divided by the ranks on the node (``LOCAL_WORLD_SIZE``, which ``torchrun`` sets;
1 without it). An explicit ``host_memory_limit`` is this rank's budget as given.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import psutil

from ..policies import Tier

__all__ = [
    "DEFAULT_HOST_FRACTION",
    "activation_host_share",
    "FreedMemory",
    "host_memory_budget",
    "local_ranks",
    "return_freed_memory",
    "split_host_budget",
]

DEFAULT_HOST_FRACTION = 0.5
"""Share of the node's available host memory that its ranks' budgets add up to by default."""


def local_ranks() -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (set by ``torchrun``), else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    try:
        return max(1, int(value))
    except ValueError:
        return 1


def host_memory_budget(
    limit: int | None = None,
    *,
    available: int | None = None,
    ranks: int | None = None,
    fraction: float = DEFAULT_HOST_FRACTION,
) -> int:
    """Bytes of host memory one rank's pools and staging buffers may hold together.

    ``limit``: the user's ``host_memory_limit`` (per rank), returned as is. Otherwise
    ``available`` (default: the node's available memory now) × ``fraction``, divided by
    ``ranks`` (default: :func:`local_ranks`)."""
    if limit is not None:
        return int(limit)
    if available is None:
        available = psutil.virtual_memory().available
    if ranks is None:
        ranks = local_ranks()
    return int(available * fraction) // max(1, ranks)


def split_host_budget(
    budget: int,
    param_pool_bytes: int,
    param_tier: Tier,
    optimizer_tier: Tier,
    staging_bytes: int = 0,
) -> tuple[int, int]:
    """(the NVMe parameter pool's share, the optimizer's share, gradients included).

    ``staging_bytes``: fixed staging buffers (device-to-host gradient copies) taken first.
    ``param_pool_bytes``: what the NVMe parameter pool wants. With both on NVMe it gets that,
    but at most half of what is left (it can run on fewer buffers), and the optimizer the
    rest; otherwise the one pool there is has all of it."""
    left = max(0, budget - int(staging_bytes))
    if not param_tier.on_nvme:
        return 0, left
    if not optimizer_tier.on_nvme:
        return left, 0
    params = min(int(param_pool_bytes), left // 2)
    return params, left - params


def activation_host_share(
    budget: int, param_tier: Tier, optimizer_tier: Tier, staging_bytes: int = 0
) -> int:
    """With activation offload on: the most bytes its host buffers may hold, taken from the
    budget right after the fixed staging buffers, before the NVMe pools. All of what is left
    when no NVMe pool shares the budget; half of it when one does (the pools are then split
    from the other half by :func:`split_host_budget`). The buffers are sized to what a
    forward offloads: a share is a ceiling, not an allocation."""
    left = max(0, budget - int(staging_bytes))
    return left // 2 if param_tier.on_nvme or optimizer_tier.on_nvme else left


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def return_freed_memory() -> None:
    """Give the pages of freed heap blocks back to the system (glibc ``malloc_trim``).

    A step frees many blocks of a few MiB (gathered parameters, gradients, activations);
    glibc keeps them in its arenas for reuse, so RSS would hold, and wander with, whatever
    the allocator kept from the last step rather than what the engine holds. Called once per
    step (the engine: as each window's backward starts, while the activations' pages are in
    use and so kept) it keeps the working set flat without allocator environment variables;
    the cost is a few ms and faulting the pages given back in again when next used."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


RETURN_EVERY_BYTES = 1 << 30
"""Bytes of large blocks freed between two :func:`return_freed_memory` calls in a stream of
frees (units released, units built)."""


class FreedMemory:
    """Returns freed heap pages (:func:`return_freed_memory`) once per ``every`` bytes of
    large blocks freed.

    Each large block freed (a gathered unit, a unit's build buffers) comes with smaller ones
    (a unit's gradients and temporaries under glibc's 32 MiB mmap threshold) that stay in the
    heap. The heap's free space is fragmented, so the next unit's blocks land on pages not
    yet resident and RSS grows by tens of MiB a unit over a pass: 0.6 GiB more at the end of
    a backward over 32 layers of 2560 with one trim per step. Counting bytes keeps the calls
    (a few ms each) rare beside the work that freed them, at any unit size. The gatherer
    counts in backward only: a forward's layers free blocks the next layer takes again, and
    each page given back is faulted in again (1.02B on a CPU device: a GiB of faults, 8% of
    the forward)."""

    def __init__(self, every: int | None = None) -> None:
        self.every = RETURN_EVERY_BYTES if every is None else every
        self._since = 0

    def freed(self, nbytes: int) -> None:
        self._since += nbytes
        if self._since >= self.every:
            self._since = 0
            return_freed_memory()
