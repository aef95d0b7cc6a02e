"""What an estimate returns: ``MemoryEstimate``, the terms of one rank for one configuration,
their sums per tier and phase (the peak is the largest phase), and the table they print as."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...memory.sizes import describe_params
from ...optim.policy import StatePolicy
from ...policies import Stage, Tier
from .state import FP32_STATE
from .terms import (
    ACTIVATIONS,
    MODEL_STATE,
    PHASES,
    RESIDENT,
    Term,
)

TIERS = tuple(Tier)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank per tier for one configuration, and the terms that make them.

    Peak of a tier = its resident terms + the largest of its other phases' terms: the
    terms of one phase are alive together, those of two phases are not (activations shrink
    as backward goes on while stage 0-1 gradients grow: their sum peaks at either end).
    ``gpu_bytes`` is the device tier's peak; host and NVMe are also given per node
    (``ranks_per_node`` ranks share a node's host memory and disk).
    """

    num_params: int
    trainable_params: int  # Ψt: the parameters with optimizer state and gradients
    num_gpus: int
    gpus_per_node: int
    stage: int
    offload_optimizer: str
    offload_param: str
    dtype: str
    shard_numel: int  # S: elements of this rank's flat shard (padded)
    trainable_shard_numel: int  # its trainable prefix: what the optimizer state covers
    device: str  # "cuda" or "cpu" (the engine on a CPU-only machine)
    terms: tuple[Term, ...]
    # the optimizer on NVMe: the share of its state in files (the rest in host memory),
    # and the bytes it moves to and from disk per step and rank; else None and 0
    nvme_fraction: float | None = None
    disk_bytes_per_step: int = 0
    host_budget: int = 0  # the rank's host budget (``swap.budget``) the estimate used
    policy: StatePolicy = FP32_STATE  # the optimizer state's kind and precisions

    @property
    def sharding(self) -> Stage:
        return Stage(self.stage)

    @property
    def optimizer_tier(self) -> Tier:
        return Tier.from_keyword(self.offload_optimizer)

    @property
    def param_tier(self) -> Tier:
        return Tier.from_keyword(self.offload_param)

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.num_gpus)

    def resident_bytes(self, tier: str | None = None) -> int:
        """What the engine's ledger (``memory_report``) shows between steps."""
        return sum(t.bytes for t in self.terms if t.phase == RESIDENT and tier in (None, t.tier))

    def peak_bytes(self, tier: str) -> int:
        phase = {
            p: sum(t.bytes for t in self.terms if t.tier == tier and t.phase == p) for p in PHASES
        }
        return phase[RESIDENT] + max(phase[p] for p in PHASES if p != RESIDENT)

    @property
    def gpu_bytes(self) -> int:
        """Peak bytes on each GPU."""
        return self.peak_bytes("device")

    @property
    def host_bytes_per_rank(self) -> int:
        return self.peak_bytes("host")

    @property
    def host_bytes_per_node(self) -> int:
        return self.ranks_per_node * self.host_bytes_per_rank

    @property
    def nvme_bytes_per_rank(self) -> int:
        return self.peak_bytes("nvme")

    @property
    def nvme_bytes_per_node(self) -> int:
        return self.ranks_per_node * self.nvme_bytes_per_rank

    def model_state_bytes(self, tier: str = "device") -> int:
        """Params + grads + optimizer state in ``tier`` (the ZeRO paper's per-GPU figure)."""
        return sum(t.bytes for t in self.terms if t.kind == MODEL_STATE and t.tier == tier)

    @property
    def activation_bytes(self) -> int | None:
        acts = [t.bytes for t in self.terms if t.kind == ACTIVATIONS]
        return sum(acts) if acts else None

    def largest_terms(self, tier: str, count: int = 3) -> list[Term]:
        return sorted(
            (t for t in self.terms if t.tier == tier and t.bytes), key=lambda t: -t.bytes
        )[:count]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_params": self.num_params,
            "trainable_params": self.trainable_params,
            "num_gpus": self.num_gpus,
            "gpus_per_node": self.gpus_per_node,
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "dtype": self.dtype,
            "optimizer_type": self.policy.kind.value,
            "moment_precision": self.policy.moments.value,
            "master_precision": self.policy.master.value,
            "optimizer_state_bytes_per_param": self.policy.bytes_per_param,
            "shard_numel": self.shard_numel,
            "trainable_shard_numel": self.trainable_shard_numel,
            "device": self.device,
            "gpu_bytes": self.gpu_bytes,
            "host_bytes_per_node": self.host_bytes_per_node,
            "nvme_bytes_per_node": self.nvme_bytes_per_node,
            "model_state_gpu_bytes": self.model_state_bytes("device"),
            "offload_optimizer_fraction": self.nvme_fraction,
            "disk_bytes_per_step_per_node": self.ranks_per_node * self.disk_bytes_per_step,
            "terms": [vars(t) for t in self.terms],
        }

    def __str__(self) -> str:
        head = (
            f"{describe_params(self.num_params, self.trainable_params)}, stage "
            f"{self.stage}, optimizer "
            f"{self.offload_optimizer}, params {self.offload_param}, {self.num_gpus} GPUs: "
            f"GPU {self.gpu_bytes / 1e9:.2f} GB, host {self.host_bytes_per_node / 1e9:.2f} "
            f"GB/node, NVMe {self.nvme_bytes_per_node / 1e9:.2f} GB/node"
            + (
                f"; {self.nvme_fraction:.0%} of the optimizer state in files, "
                f"{self.ranks_per_node * self.disk_bytes_per_step / 1e9:.2f} GB/node of "
                "disk traffic per step"
                if self.nvme_fraction is not None
                else ""
            )
        )
        rows = [
            f"  {t.tier:<6} {t.phase:<16} {t.bytes / 1e9:>9.3f} GB  {t.name} ({t.formula})"
            for t in self.terms
        ]
        return "\n".join([head, *rows])
