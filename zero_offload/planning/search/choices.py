"""Each stage × offload choice weighed against the limits: its estimate, an NVMe optimizer
given the node's spare host memory, the cheapest activation measures that fit, and how much
more of each resource, or how many more GPUs, would make one fit."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from ...optim.policy import StatePolicy
from ...policies import Tier
from ...update.nvme.sizing import FULL_SPEED_GROUP
from ..estimate.memory import MemoryEstimate, ModelShape, estimate_memory
from ..estimate.state import state_bytes
from .candidate import Candidate, StateRow
from .measures import Measures, MicroBatch, cheapest
from .precisions import state_rows
from .reasons import gb, why_over

# (stage, offload_optimizer, offload_param), least offloaded first. Param offload to host
# memory comes before the optimizer on NVMe: moving 2 bytes/param over PCIe costs less per step
# than reading and writing 24 bytes/param on a disk. Within one offload choice, the lowest
# stage (least sharding, least communication) comes first.
CHOICES: tuple[tuple[int, str, str], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (3, "none", "none"),
    (1, "cpu", "none"),
    (2, "cpu", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
    (1, "nvme", "none"),
    (2, "nvme", "none"),
    (3, "nvme", "none"),
    (3, "nvme", "cpu"),
    (3, "cpu", "nvme"),
    (3, "nvme", "nvme"),
)


_MAX_GPUS = 4096


def _within(need: float, usable: float | None) -> bool:
    """Whether ``need`` fits; ``usable`` None: a tier not measured (NVMe space)."""
    return usable is None or need <= usable


def _fits(e: MemoryEstimate, limits: dict[str, float | None]) -> bool:
    needs = {
        Tier.DEVICE: e.gpu_bytes,
        Tier.HOST: e.host_bytes_per_node,
        Tier.NVME: e.nvme_bytes_per_node,
    }
    return all(_within(needs[t], limits[t]) for t in needs)


def _fill_host(
    shape: ModelShape,
    limits: dict[str, float | None],
    num_gpus: int,
    est_kwargs: dict[str, Any],
    stage: int,
    par: str,
    all_nvme: MemoryEstimate,
) -> tuple[MemoryEstimate, int] | None:
    """The optimizer on NVMe, with the node's spare usable host memory holding its leading
    sub-groups: ``offload_optimizer_fraction="auto"`` under the largest ``host_memory_limit``
    whose estimate still fits (found in a few steps: host use grows with the limit by whole
    sub-groups). None when nothing moves to the host."""
    usable = limits[Tier.HOST]
    if usable is None or not _fits(all_nvme, limits):
        return None
    ranks = all_nvme.ranks_per_node
    limit, best, best_fraction = all_nvme.host_budget, None, 1.0
    for _ in range(6):
        e = estimate_memory(
            shape,
            num_gpus=num_gpus,
            stage=stage,
            offload_optimizer="nvme",
            offload_param=par,
            offload_optimizer_fraction="auto",
            host_memory_limit=limit,
            **est_kwargs,
        )
        fraction = e.nvme_fraction
        assert fraction is not None  # an NVMe optimizer's estimate says its split
        spare = int(usable // ranks) - e.host_bytes_per_rank
        if spare >= 0 and _fits(e, limits) and (best is None or fraction < best_fraction):
            best, best_fraction = (e, limit), fraction
        group = state_bytes(all_nvme.policy, FULL_SPEED_GROUP)  # a default sub-group's state
        if fraction == 0 or 0 <= spare < group:
            break
        # over: back off by a whole sub-group more, as the host part shrinks by sub-groups
        limit = max(1, limit + spare - (group if spare < 0 else 0))
    if best is None or best_fraction >= 1.0:
        return None
    return best


def _candidate(
    shape: ModelShape,
    limits: dict[str, float | None],
    num_gpus: int,
    est_kwargs: dict[str, Any],
    stage: int,
    opt: str,
    par: str,
    measures: Measures | None = None,
) -> Candidate:
    e = estimate_memory(
        shape,
        num_gpus=num_gpus,
        stage=stage,
        offload_optimizer=opt,
        offload_param=par,
        **est_kwargs,
    )
    extra: dict[str, Any] = {}
    filled = (
        _fill_host(shape, limits, num_gpus, est_kwargs, stage, par, e)
        if e.optimizer_tier.on_nvme
        else None
    )
    if filled is not None:
        extra = dict(host_memory_limit=filled[1], all_nvme_disk_bytes=e.disk_bytes_per_step)
        e = filled[0]
    cand = Candidate(stage, opt, par, e, True, ())
    reasons = []
    for tier, need in cand.needs().items():
        usable = limits[tier]
        if usable is None or need <= usable:  # None: NVMe space not measured
            continue
        reasons.append(why_over(e, tier, need, usable))
    unchecked = cand.uses_nvme and limits[Tier.NVME] is None
    return Candidate(
        stage, opt, par, e, not reasons, tuple(reasons), unchecked, measures=measures, **extra
    )


def _with_measures(
    shape: ModelShape,
    limits: dict[str, float | None],
    num_gpus: int,
    est_kwargs: dict[str, Any],
    choice: tuple[int, str, str],
    micro: MicroBatch,
    rungs: tuple[Measures, ...],
) -> Candidate:
    """``choice`` with the cheapest activation measures that fit (and the cheaper ones that
    do not), else with the strongest."""

    @functools.cache
    def at(m: Measures) -> Candidate:
        kw = dict(est_kwargs, activations=micro.activations(m))
        return _candidate(shape, limits, num_gpus, kw, *choice, measures=m)

    m, cheaper = cheapest(rungs, lambda m: (at(m).fits, at(m).estimate.gpu_bytes))
    return replace(at(m), cheaper=cheaper)


def _one(
    shape: ModelShape,
    limits: dict[str, float | None],
    num_gpus: int,
    est_kwargs: dict[str, Any],
    choice: tuple[int, str, str],
    micro: MicroBatch | None,
    rungs: tuple[Measures, ...],
) -> Candidate:
    if micro is None:
        return _candidate(shape, limits, num_gpus, est_kwargs, *choice)
    return _with_measures(shape, limits, num_gpus, est_kwargs, choice, micro, rungs)


def _evaluate(
    shape: ModelShape,
    limits: dict[str, float | None],
    num_gpus: int,
    est_kwargs: dict[str, Any],
    micro: MicroBatch | None = None,
    rungs: tuple[Measures, ...] = (),
) -> list[Candidate]:
    return [_one(shape, limits, num_gpus, est_kwargs, c, micro, rungs) for c in CHOICES]


def evaluate_states(
    shape: ModelShape,
    limits: dict[str, float | None],
    num_gpus: int,
    est_kwargs: dict[str, Any],
    micro: MicroBatch | None,
    rungs: tuple[Measures, ...],
    optimizer_type: str,
    allow_low_precision: bool,
    given: StatePolicy | None = None,
) -> tuple[list[StateRow], StateRow, dict[str, Any], list[Candidate]]:
    """``precisions.state_rows`` over ``CHOICES`` with this plan's estimate (``given``: the
    one policy to plan for)."""

    def one(kw: dict[str, Any], c: tuple[int, str, str]) -> Candidate:
        return _one(shape, limits, num_gpus, kw, c, micro, rungs)

    return state_rows(
        one,
        CHOICES,
        est_kwargs,
        optimizer_type,
        shape.trainable_params,
        allow_low_precision,
        given,
    )


def what_would_fit(
    cands: list[Candidate],
    limits: dict[str, float | None],
    headroom: float,
    shape: ModelShape,
    num_gpus: int,
    est_kwargs: dict[str, Any],
    micro: MicroBatch | None = None,
    rungs: tuple[Measures, ...] = (),
) -> list[str]:
    """For each resource: the least of it that makes some choice fit, the others unchanged;
    then the fewest GPUs (doubling) at which something fits."""
    out = []
    for tier, unit in (
        (Tier.DEVICE, "GPU memory per GPU"),
        (Tier.HOST, "host memory per node"),
        (Tier.NVME, "NVMe space per node"),
    ):
        best = None
        for c in cands:
            needs = c.needs()
            others_fit = all(_within(needs[t], limits[t]) for t in needs if t != tier)
            if others_fit and (best is None or needs[tier] < best.needs()[tier]):
                best = c
        if best is not None and best.needs()[tier] > 0:
            total = best.needs()[tier] / (1 - headroom)
            out.append(
                f"{unit} >= {gb(total)} would fit stage {best.stage}, optimizer "
                f"{best.offload_optimizer}, params {best.offload_param}"
            )
    n = num_gpus * 2
    while n <= _MAX_GPUS:
        fitting = [c for c in _evaluate(shape, limits, n, est_kwargs, micro, rungs) if c.fits]
        if fitting:
            c = fitting[0]
            out.append(
                f"{n} GPUs (same memory each) would fit stage {c.stage}, optimizer "
                f"{c.offload_optimizer}, params {c.offload_param}"
            )
            break
        n *= 2
    return out
