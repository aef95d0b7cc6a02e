"""The plan's sentences about one choice: why it does not fit (the largest terms of the tier
over its limit, and what would remove the biggest), and how its optimizer state is split
between host memory and NVMe."""

from __future__ import annotations

from ...policies import Tier
from ..estimate.memory import MemoryEstimate
from .candidate import Candidate

__all__ = ["gb", "split_text", "why_over"]

_TIER_LABEL = {Tier.DEVICE: "GPU", Tier.HOST: "host", Tier.NVME: "NVMe"}


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def why_over(e: MemoryEstimate, tier: Tier, need: int, usable: float) -> str:
    """ "GPU 84.5 GB > 21.6 GB usable: optimizer state 39.0 GB, params 26.0 GB, ..." plus what
    would remove the biggest obstacle."""
    per_node = e.ranks_per_node if tier.offloaded else 1
    where = "/node" if tier.offloaded else ""
    top = ", ".join(f"{t.name} {gb(t.bytes * per_node)}" for t in e.largest_terms(tier))
    if usable <= 0:
        return f"no {_TIER_LABEL[tier]} given: needs {gb(need)}{where}"
    text = f"{_TIER_LABEL[tier]} {gb(need)}{where} > {gb(usable)} usable: {top}"
    by_name = {t.name: t.bytes * per_node for t in e.terms if t.tier == tier}
    if not tier.offloaded and by_name.get("params", 0) > usable:
        text += (
            f"; the full {e.dtype} params alone ({gb(by_name['params'])}) exceed it, "
            "whatever is offloaded: only stage 3 shards them"
        )
    elif not tier.offloaded and "optimizer state" in by_name:
        text += "; offload the optimizer state (offload_optimizer) or use more GPUs"
    elif tier.on_host and "optimizer state" in by_name:
        text += "; put the optimizer state on NVMe (offload_optimizer='nvme')" + (
            " or allow lower-precision state (allow_low_precision_states)"
            if e.policy.is_default
            else ""
        )
    return text


def split_text(c: Candidate) -> str:
    """ " The optimizer state: 64% on NVMe, ...; disk traffic ... (vs ... all on NVMe)"."""
    e = c.estimate
    if e.nvme_fraction is None:
        return ""
    per_node = e.ranks_per_node
    text = (
        f" Optimizer state {e.nvme_fraction:.0%} on NVMe, {1 - e.nvme_fraction:.0%} in "
        f"host memory: {gb(per_node * e.disk_bytes_per_step)} of disk traffic per step "
        "per node"
    )
    if c.all_nvme_disk_bytes:
        saved = 1 - e.disk_bytes_per_step / c.all_nvme_disk_bytes
        text += f", {saved:.0%} less than all on NVMe ({gb(per_node * c.all_nvme_disk_bytes)})"
    return text + "."
