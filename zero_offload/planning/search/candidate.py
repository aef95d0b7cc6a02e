"""What :func:`~.planner.plan` returns: each stage × offload choice it tried
(:class:`Candidate`), each optimizer-state precision's row (:class:`StateRow`) and its
outcome (:class:`Plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...optim.policy import StatePolicy
from ...policies import Tier
from ..estimate.memory import MemoryEstimate
from ..estimate.state import FP32_STATE, per_param_text, state_bytes
from .measures import Measures

__all__ = ["Candidate", "Plan", "StateRow"]


@dataclass(frozen=True)
class Candidate:
    """One stage × offload choice, its estimate, and whether (or why not) it fits."""

    stage: int
    offload_optimizer: str
    offload_param: str
    estimate: MemoryEstimate
    fits: bool
    reasons: tuple[str, ...]  # why it does not fit (empty when it fits)
    nvme_unchecked: bool = False  # it needs NVMe space that nobody measured
    # the optimizer on NVMe with part of it in host memory: the host_memory_limit that
    # gives it the node's spare host memory, and the disk traffic of the all-NVMe placement
    host_memory_limit: int | None = None
    all_nvme_disk_bytes: int = 0
    # with a micro-batch: the activation measures it needs, and the cheaper ones that do not
    # fit (with the GPU bytes each would need)
    measures: Measures | None = None
    cheaper: tuple[tuple[Measures, int], ...] = ()

    @property
    def uses_nvme(self) -> bool:
        return self.estimate.optimizer_tier.on_nvme or self.estimate.param_tier.on_nvme

    def needs(self) -> dict[Tier, int]:
        """Bytes it needs: per GPU, host per node, NVMe per node."""
        e = self.estimate
        return {
            Tier.DEVICE: e.gpu_bytes,
            Tier.HOST: e.host_bytes_per_node,
            Tier.NVME: e.nvme_bytes_per_node,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "fits": self.fits,
            "reasons": list(self.reasons),
            "nvme_unchecked": self.nvme_unchecked,
            "gpu_bytes": self.estimate.gpu_bytes,
            "host_bytes_per_node": self.estimate.host_bytes_per_node,
            "nvme_bytes_per_node": self.estimate.nvme_bytes_per_node,
            "offload_optimizer_fraction": self.estimate.nvme_fraction,
            "host_memory_limit": self.host_memory_limit,
            "disk_bytes_per_step_per_node": self.estimate.ranks_per_node
            * self.estimate.disk_bytes_per_step,
            "all_nvme_disk_bytes_per_step_per_node": self.estimate.ranks_per_node
            * self.all_nvme_disk_bytes,
            "measures": None if self.measures is None else vars(self.measures),
            "cheaper_measures": [{**vars(m), "gpu_bytes": gpu} for m, gpu in self.cheaper],
        }


@dataclass(frozen=True)
class StateRow:
    """One state precision: its least-offloaded choice that fits (None: nothing fits)."""

    label: str
    policy: StatePolicy
    choice: Candidate | None
    trainable_params: int

    @property
    def total_state_bytes(self) -> int:
        """The whole optimizer state of the trainable params, all ranks, wherever it lives."""
        return state_bytes(self.policy, self.trainable_params)

    def describe(self) -> str:
        return f"{self.label} ({per_param_text(self.policy.bytes_per_param)} B/param)"

    def to_dict(self) -> dict[str, Any]:
        c = self.choice
        return {
            "label": self.label,
            "optimizer_type": self.policy.kind.value,
            "moment_precision": self.policy.moments.value,
            "master_precision": self.policy.master.value,
            "bytes_per_param": self.policy.bytes_per_param,
            "state_bytes": self.total_state_bytes,
            "fits": c is not None,
            "choice": None if c is None else c.to_dict(),
        }


@dataclass(frozen=True)
class Plan:
    """The outcome of :func:`plan`. ``kwargs``: pass to ``zo.initialize(model, **kwargs)``
    (empty when nothing fits). ``explanation``: why this choice, or why none and what would."""

    fits: bool
    kwargs: dict[str, Any]
    choice: Candidate | None
    candidates: tuple[Candidate, ...]
    explanation: str
    gpu_memory: int
    host_memory: int | None  # None: not checked
    nvme_bytes: int | None  # None: not measured (NVMe choices assumed to have room)
    headroom: float
    notes: tuple[str, ...] = field(default=())
    # a row per optimizer-state precision, the one the plan took, and whether lower
    # precision than fp32 was allowed (``allow_low_precision_states``)
    states: tuple[StateRow, ...] = ()
    policy: StatePolicy = FP32_STATE
    allow_low_precision_states: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "kwargs": self.kwargs,
            "explanation": self.explanation,
            "gpu_memory": self.gpu_memory,
            "host_memory": self.host_memory,
            "nvme_bytes": self.nvme_bytes,
            "headroom": self.headroom,
            "notes": list(self.notes),
            "choice": self.choice.estimate.to_dict() if self.choice else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "optimizer_states": [r.to_dict() for r in self.states],
            "allow_low_precision_states": self.allow_low_precision_states,
        }
