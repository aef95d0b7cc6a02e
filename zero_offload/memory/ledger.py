"""The memory ledger: what one rank holds, per tier and kind, counted from real tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..comm import CollectiveStats
from ..policies import Tier

__all__ = ["MemoryReport", "TIERS", "KINDS"]

TIERS = tuple(Tier)  # "device", "host", "nvme": a Tier is its name
KINDS = ("params", "grads", "optimizer", "activations")


@dataclass
class MemoryReport:
    """``bytes[tier][kind]``: bytes this rank holds (``activations``: the host buffers of
    activation offload, sized to what a forward offloads). ``peak_gathered_param_bytes``: the most
    stage-3 gathered (non-persistent) parameter bytes held at once during the last step
    (and the one in progress). ``persistent_param_bytes``: stage-3 units kept whole.
    ``pinned_bytes``: page-locked host bytes (registered with ``cudaHostRegister``, which
    ``torch.cuda.host_memory_stats`` does not see): of the host tier, plus the step's small
    buffer for units cut by NVMe sub-groups. ``comm``: what each kind of collective moved in
    the last step (see :mod:`zero_offload.comm`)."""

    bytes: dict[str, dict[str, int]] = field(
        default_factory=lambda: {t: {k: 0 for k in KINDS} for t in TIERS}
    )
    peak_gathered_param_bytes: int = 0
    persistent_param_bytes: int = 0
    pinned_bytes: int = 0
    comm: dict[str, CollectiveStats] = field(default_factory=dict)

    def add(self, tier: str, kind: str, nbytes: int, *, pinned: int = 0) -> None:
        """``pinned``: how many of ``nbytes`` are page-locked host memory."""
        self.bytes[tier][kind] += int(nbytes)
        self.pinned_bytes += int(pinned)

    def total(self, tier: str | None = None, kind: str | None = None) -> int:
        return sum(
            n
            for t, kinds in self.bytes.items()
            if tier in (None, t)
            for k, n in kinds.items()
            if kind in (None, k)
        )

    def __str__(self) -> str:
        rows = [f"{'tier':<8}" + "".join(f"{k:>14}" for k in KINDS)]
        for t in TIERS:
            rows.append(
                f"{t:<8}" + "".join(f"{self.bytes[t][k] / 2**20:>11.1f} MiB" for k in KINDS)
            )
        rows.append(f"pinned host memory: {self.pinned_bytes / 2**20:.1f} MiB")
        rows.append(f"peak gathered params: {self.peak_gathered_param_bytes / 2**20:.1f} MiB")
        for kind, s in sorted(self.comm.items()):
            rows.append(f"{kind}: {s.calls} calls, {s.bytes / 2**20:.1f} MiB")
        return "\n".join(rows)
