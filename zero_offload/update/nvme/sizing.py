"""How the NVMe optimizer uses its share of the host budget: sized to the shard and the
budget, not to the ``sub_group_size`` setting (``docs/host_memory.md``).

Three pipeline buffers hold one sub-group's [master | m | v] each (one read ahead, one being
stepped, one written back). With the old rule, a sub-group of ``sub_group_size`` (1e8) larger
than the shard made each buffer the whole optimizer state; here the default sub-group is
what keeps the disk busy, and the fp32 gradient shard shares the same budget.

Some sub-groups may keep their [master | m | v] in host memory (``offload_optimizer_fraction``):
:func:`host_groups` says how many, from a fixed NVMe share or, with "auto", from what the
budget has left beside the pipeline, and :func:`host_placement` which ones: the sub-groups in
files spread evenly between them. The engine and the planner both call these, so the split
the plan shows is the one a run gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...grads.disk import DiskGrads
from ...optim.policy import ADAM_STATE_BYTES
from ...swap.buffers import pool_footprint as _footprint

__all__ = [
    "FULL_SPEED_GROUP",
    "PIPELINE_BUFFERS",
    "NvmeSizing",
    "OptimizerSplit",
    "full_group",
    "host_groups",
    "host_placement",
    "nvme_sizing",
    "out_itemsize",
    "optimizer_split",
]

PIPELINE_BUFFERS = 3  # one being read ahead, one computing, one being written back
FULL_SPEED_GROUP = 1 << 23
"""Default params per sub-group: 96 MiB of [master | m | v], twelve of the swap engine's
8 MiB blocks, enough to keep its queue full; larger sub-groups only cost host memory."""
_PAGE_ELEMS = 1024  # fp32 elements per 4 KiB: sub-groups start page-aligned in their files
_SMALLEST_HOST_GRAD_GROUP = 1 << 20  # below this, gradients go to disk rather than shrink more
_PIPELINE_GROUPS = 4  # a small shard is still cut in this many: three buffers, not three shards


@dataclass(frozen=True)
class NvmeSizing:
    """How the NVMe optimizer uses its share of the host budget: params per sub-group,
    whether the fp32 gradient shard is in files, and how many pipeline buffers it asks for."""

    group: int
    grads_on_disk: bool
    buffers: int

    def host_bytes(self, numel: int, out_itemsize: int) -> int:
        """What it holds in host memory, as the pools round it: the state pipeline, the
        compute-dtype output of one sub-group, and the gradient shard or its pipeline."""
        return self.state_bytes() + self.out_bytes(out_itemsize) + self.grad_bytes(numel)

    def state_bytes(self) -> int:
        """The pipeline buffers of [master | m | v], as the pool rounds them."""
        return self.buffers * _footprint(ADAM_STATE_BYTES * self.group)

    def out_bytes(self, out_itemsize: int) -> int:
        """One sub-group's new parameters in the compute dtype (:func:`out_itemsize`)."""
        return out_itemsize * self.group

    def grad_bytes(self, numel: int) -> int:
        """The fp32 gradient shard in host memory, or the buffers of its files."""
        return DiskGrads.host_bytes(self.group, self.buffers) if self.grads_on_disk else 4 * numel


def full_group(numel: int, sub_group_size: int) -> int:
    """The sub-group before any budget shrinks it: ``sub_group_size`` at most,
    :data:`FULL_SPEED_GROUP` by default, and a quarter of a smaller shard, in whole pages."""
    pages = -(-numel // _PAGE_ELEMS)
    size = min(
        sub_group_size // _PAGE_ELEMS,
        FULL_SPEED_GROUP // _PAGE_ELEMS,
        -(-pages // _PIPELINE_GROUPS),
    )
    return max(1, size) * _PAGE_ELEMS


def out_itemsize(fp32_master: bool, dtype_bytes: int) -> int:
    """Bytes per element of the new compute-dtype parameters a step writes out of the
    optimizer: none where an fp32 master is itself the fp32 parameters."""
    return 0 if fp32_master and dtype_bytes == 4 else dtype_bytes


def nvme_sizing(numel: int, sub_group_size: int, budget: int, out_item: int) -> NvmeSizing:
    """Size the NVMe optimizer to its shard and budget, not the budget to the setting.

    The sub-group is ``sub_group_size`` at most, :data:`FULL_SPEED_GROUP` by default, and a
    quarter of a smaller shard. The fp32 gradient shard stays in host memory when it fits the
    budget beside the pipeline (which may shrink to 1M-param sub-groups for it); otherwise
    gradients go to files and the sub-group shrinks until everything fits."""
    size = full_group(numel, sub_group_size)

    def sizing(n: int, on_disk: bool) -> NvmeSizing:
        groups = -(-numel // n) if numel else 1
        return NvmeSizing(n, on_disk, max(2, min(PIPELINE_BUFFERS, groups)))

    def fit(n: int, on_disk: bool, floor: int) -> NvmeSizing:
        while n > floor and sizing(n, on_disk).host_bytes(numel, out_item) > budget:
            need = sizing(n, on_disk).host_bytes(numel, out_item)
            n = max(floor, min(n - _PAGE_ELEMS, n * budget // need // _PAGE_ELEMS * _PAGE_ELEMS))
        return sizing(n, on_disk)

    in_host = fit(size, False, min(size, _SMALLEST_HOST_GRAD_GROUP))
    if in_host.host_bytes(numel, out_item) <= budget:
        return in_host
    return fit(size, True, _PAGE_ELEMS)


@dataclass(frozen=True)
class OptimizerSplit:
    """Where a shard of ``numel`` optimizer elements lives: ``host_numel`` of them (whole
    sub-groups, placed by :func:`host_placement`) in host memory, the rest in files;
    ``sizing`` is the NVMe pipeline's."""

    numel: int
    sizing: NvmeSizing
    host_numel: int

    @property
    def nvme_numel(self) -> int:
        return self.numel - self.host_numel

    @property
    def nvme_fraction(self) -> float:
        """Share of the optimizer state in files (1.0 for an empty shard)."""
        return self.nvme_numel / self.numel if self.numel else 1.0

    @property
    def host_state_bytes(self) -> int:
        return ADAM_STATE_BYTES * self.host_numel

    def disk_bytes_per_step(self) -> int:
        """Bytes the optimizer moves to and from disk per step: [master | m | v] of the NVMe
        sub-groups read and written, plus the fp32 gradients written during backward and read
        at the step when they are in files."""
        return 24 * self.nvme_numel + (8 * self.numel if self.sizing.grads_on_disk else 0)


def host_groups(numel: int, group: int, fraction: float | str | None, spare: int) -> int:
    """How many sub-groups of ``group`` elements keep their state in host memory.

    ``fraction``: the share in files (None: 1.0, all of it); the host keeps the nearest
    whole number of sub-groups to the rest. ``"auto"``: as many as ``spare`` bytes hold at
    12 bytes per element (the budget left beside the NVMe pipeline)."""
    groups = -(-numel // group) if numel else 0
    if fraction is None or groups == 0:
        return 0
    if fraction == "auto":
        if spare >= ADAM_STATE_BYTES * numel:
            return groups
        return max(0, min(groups, int(spare) // (ADAM_STATE_BYTES * group)))
    target = (1.0 - float(fraction)) * numel  # elements in host memory, as asked
    below = min(groups, int(target // group))
    return min((below, min(groups, below + 1)), key=lambda k: abs(min(k * group, numel) - target))


def host_placement(groups: int, host: int) -> tuple[bool, ...]:
    """Which of ``groups`` sub-groups (in pipeline order) keep their state in host memory,
    ``host`` of them: the ones in files spread evenly between them, the first after a
    stretch in host memory and the last (the shard's short remainder) last.

    Every update steps the sub-groups in order, under the next forward as it reaches their
    units, and the pipeline reads one sub-group in files ahead. Spread, the disk reads the
    next file while the sub-groups in host memory before it are stepped and their units
    computed. With the host ones leading, the disk idled through that first stretch and the
    forward then waited on every read: at 99M with half the state in files the forward took
    its compute plus the update's disk time."""
    files = groups - host
    on_host = [True] * groups
    for j in range(files):
        on_host[-(-(j + 1) * groups // files) - 1] = False
    return tuple(on_host)


def optimizer_split(
    numel: int, sub_group_size: int, budget: int, out_item: int, fraction: float | str | None
) -> OptimizerSplit:
    """The NVMe sizing of :func:`nvme_sizing` and how many elements stay in host memory:
    the one rule the engine and the planner share (``out_item``: :func:`out_itemsize`)."""
    sizing = nvme_sizing(numel, sub_group_size, budget, out_item)
    spare = budget - sizing.host_bytes(numel, out_item)
    count = host_groups(numel, sizing.group, fraction, spare)
    return OptimizerSplit(numel, sizing, min(numel, count * sizing.group))
