"""The optimizer state in the estimate: its bytes per element come from the
:class:`~zero_offload.optim.policy.StatePolicy` (kind, moment and master precision), never
from a literal 12.

The NVMe placement is the engine's rule (``update.nvme.sizing``: the sub-group, whether the
gradients go to files, how many sub-groups stay in host memory) counted in the
policy's bytes: the pipeline buffers hold a sub-group of the policy's state, and the host part
under ``offload_optimizer_fraction="auto"`` is as many sub-groups as the spare budget holds at
the policy's bytes per element. With the default policy (fp32 AdamW, 12 bytes) this is
exactly ``optimizer_split``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ...errors import ConfigError
from ...optim.layout import StateLayout
from ...optim.policy import MasterPrecision, MomentPrecision, StatePolicy
from ...params.units import UnitPlan
from ...swap.buffers import pool_footprint
from ...update.nvme.sizing import (
    NvmeSizing,
    OptimizerSplit,
    host_groups,
    nvme_sizing,
    out_itemsize,
)

__all__ = [
    "FP32_STATE",
    "StateSplit",
    "moment_bytes",
    "per_param_text",
    "state_bytes",
    "state_rate",
    "state_names",
    "state_policy",
    "state_split",
]

FP32_STATE = StatePolicy()
"""The default: fp32 master + Adam's m and v, what the engine's fp32 rules count."""


def state_policy(
    optimizer_type: str = "adamw",
    moment_precision: str = "fp32",
    master_precision: str = "fp32",
    fp32_moment_params: Iterable[str] = (),
) -> StatePolicy:
    """The policy of the config keywords of the same names (a ConfigError names a bad one)."""
    if isinstance(fp32_moment_params, str):
        raise ConfigError("fp32_moment_params must be a list of parameter names, not a string")
    try:
        return StatePolicy.parse(
            optimizer_type, moment_precision, master_precision, fp32_moment_params
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def state_bytes(policy: StatePolicy, numel: int) -> int:
    """Bytes of the whole state (master and moments) over ``numel`` elements of large
    parameters (8-bit moments: one absmax per block amortized; rounded up)."""
    return math.ceil(policy.bytes_per_param * numel)


def state_rate(policy: StatePolicy, plans: list[UnitPlan] | None) -> float:
    """State bytes per element of a rank's trainable shard: with the engine's units, counted
    by the optimizer's own :class:`~zero_offload.optim.layout.StateLayout` of rank 0's run
    (8-bit: parameters under 4096 elements and padding in fp32, blocks cut at shard edges);
    for a parameter count, the policy's ``bytes_per_param``."""
    trained = [(p.layout, 0) for p in plans or () if not p.frozen]
    numel = sum(p.layout.shard_numel for p in plans or () if not p.frozen)
    if policy.is_default or not numel:
        return policy.bytes_per_param
    return StateLayout.for_shards(policy, trained).nbytes / numel


def moment_bytes(policy: StatePolicy, numel: int, rate: float | None = None) -> int:
    """Bytes of the moments alone (the state where fp32 parameters are themselves the
    master), at ``rate`` state bytes per element (default: the policy's)."""
    rate = policy.bytes_per_param if rate is None else rate
    return math.ceil((rate - policy.master_bytes(1)) * numel)


def per_param_text(bytes_per_param: float) -> str:
    """'12', '8', '4.03': bytes per element as the formulas write them."""
    return f"{bytes_per_param:.2f}".rstrip("0").rstrip(".")


def state_names(policy: StatePolicy, master: bool = True) -> str:
    """'fp32 master, m, v'; '8-bit m, v, bf16_sr master'; 'Lion's fp32 m'."""
    names = {"exp_avg": "m", "exp_avg_sq": "v", "sum": "sum of squares"}
    moments = ", ".join(names[n] for n in policy.moment_names)
    if policy.moments is not MomentPrecision.FP32 or policy.kind.value in ("lion", "adagrad"):
        label = "8-bit" if policy.quantized else policy.moments.value
        moments = f"{label} {moments}"
    if not master:
        return moments
    if policy.master is MasterPrecision.FP32:
        return f"fp32 master, {moments}"
    return f"{moments}, {policy.master.value} master"


@dataclass(frozen=True)
class StateSplit:
    """The engine's split of a shard's optimizer state (``OptimizerSplit``) in the policy's
    bytes: what is in host memory, in files, in the pipeline buffers, and moved per step."""

    split: OptimizerSplit
    policy: StatePolicy
    rate: float  # state bytes per element (``state_rate``)

    def state_bytes(self, numel: int) -> int:
        return math.ceil(self.rate * numel)

    @property
    def sizing(self) -> NvmeSizing:
        return self.split.sizing

    @property
    def numel(self) -> int:
        return self.split.numel

    @property
    def host_numel(self) -> int:
        return self.split.host_numel

    @property
    def nvme_numel(self) -> int:
        return self.split.nvme_numel

    @property
    def nvme_fraction(self) -> float:
        return self.split.nvme_fraction

    @property
    def host_state_bytes(self) -> int:
        return self.state_bytes(self.host_numel)

    @property
    def nvme_state_bytes(self) -> int:
        return self.state_bytes(self.nvme_numel)

    @property
    def pipeline_bytes(self) -> int:
        """The pipeline buffers, each one sub-group of state, as the pool rounds them."""
        return self.sizing.buffers * pool_footprint(self.state_bytes(self.sizing.group))

    def disk_bytes_per_step(self) -> int:
        """The state in files read and written once a step, plus the gradients' traffic
        when they are in files (the engine's rule, which does not depend on the state)."""
        grads = self.split.disk_bytes_per_step() - 2 * state_bytes(FP32_STATE, self.nvme_numel)
        return 2 * self.nvme_state_bytes + grads


def state_split(
    policy: StatePolicy,
    numel: int,
    sub_group_size: int,
    budget: int,
    dtype_bytes: int,
    fraction: float | str | None,
    rate: float | None = None,
) -> StateSplit:
    """Where the optimizer state of ``numel`` elements lives under ``budget``: the engine's
    ``nvme_sizing`` and ``host_groups``, with the spare budget counted in the policy's bytes
    (``host_groups`` counts fp32 state, so the spare is scaled to it). ``rate``: state bytes
    per element (default: the policy's)."""
    rate = policy.bytes_per_param if rate is None else rate
    out_item = out_itemsize(policy.master is MasterPrecision.FP32, dtype_bytes)
    sizing = nvme_sizing(numel, sub_group_size, budget, out_item)
    split = StateSplit(OptimizerSplit(numel, sizing, 0), policy, rate)
    held = sizing.host_bytes(numel, out_item) - sizing.state_bytes() + split.pipeline_bytes
    spare = budget - held
    as_fp32 = spare * FP32_STATE.bytes_per_param / rate
    count = host_groups(numel, sizing.group, fraction, math.floor(as_fp32))
    return StateSplit(OptimizerSplit(numel, sizing, min(numel, count * sizing.group)), policy, rate)
