"""Which ZeRO stage and offload choice fit a model on given GPUs, host memory and NVMe.

``estimate_memory`` (in :mod:`zero_offload.planning.estimate.memory`) computes what each rank
holds per tier; :func:`plan` tries every stage × offload choice from the least offloaded
(fastest) to the most, and returns the first that fits as keyword arguments for
``initialize`` — or, when none does, says why and what would (more GPU memory, host memory,
NVMe space or GPUs).

With the optimizer on NVMe, the host memory a choice leaves free is not wasted: the plan gives
it to the optimizer (``offload_optimizer_fraction="auto"`` with a ``host_memory_limit`` that
fills the node's usable host memory), so the leading sub-groups stay in host memory and the
disk moves only the rest each step. The engine places them by the same rule
(``update.nvme_sizing.optimizer_split``).
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from ...update.nvme_sizing import FULL_SPEED_GROUP
from ..estimate.memory import (
    MemoryEstimate,
    ModelShape,
    Term,
    _dtype_name,
    activation_memory,
    describe_params,
    estimate_memory,
)
from ..estimate.state import state_bytes
from .candidate import Candidate, Plan
from .measures import Measures, MicroBatch, cheapest, explain, micro_batch_for
from .precisions import StateRow, policy_keys, state_rows, states_text
from .reasons import gb as _gb
from .reasons import split_text, why_over

__all__ = [
    "estimate_memory",
    "activation_memory",
    "plan",
    "Plan",
    "Candidate",
    "MemoryEstimate",
    "Term",
    "CHOICES",
]

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
_UNCHECKED_HOST = 1 << 50  # host_memory=None: the budget of a node that is never short


def _within(need: float, usable: float | None) -> bool:
    """Whether ``need`` fits; ``usable`` None: a tier not measured (NVMe space)."""
    return usable is None or need <= usable


def _fits(e: MemoryEstimate, limits: dict[str, float | None]) -> bool:
    needs = {"device": e.gpu_bytes, "host": e.host_bytes_per_node, "nvme": e.nvme_bytes_per_node}
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
    usable = limits["host"]
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
        _fill_host(shape, limits, num_gpus, est_kwargs, stage, par, e) if opt == "nvme" else None
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
    unchecked = cand.uses_nvme and limits["nvme"] is None
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


def _state_rows(
    shape: ModelShape,
    limits: dict[str, float | None],
    num_gpus: int,
    est_kwargs: dict[str, Any],
    micro: MicroBatch | None,
    rungs: tuple[Measures, ...],
    optimizer_type: str,
    allow_low_precision: bool,
) -> tuple[list[StateRow], StateRow, dict[str, Any], list[Candidate]]:
    """``precisions.state_rows`` over ``CHOICES`` with this plan's estimate."""

    def one(kw: dict[str, Any], c: tuple[int, str, str]) -> Candidate:
        return _one(shape, limits, num_gpus, kw, c, micro, rungs)

    return state_rows(
        one, CHOICES, est_kwargs, optimizer_type, shape.trainable_params, allow_low_precision
    )


def _what_would_fit(
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
        ("device", "GPU memory per GPU"),
        ("host", "host memory per node"),
        ("nvme", "NVMe space per node"),
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
                f"{unit} >= {_gb(total)} would fit stage {best.stage}, optimizer "
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


def plan(
    model_or_num_params: nn.Module | int | float | ModelShape,
    *,
    num_gpus: int,
    gpu_memory: int,
    host_memory: int | None,
    nvme_bytes: int | None = None,
    activation_bytes: int | None = None,
    gpus_per_node: int | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    prefetch_depth: int = 2,
    largest_layer_params: int | None = None,
    nvme_path: str | os.PathLike | None = None,
    headroom: float = 0.1,
    trainable_params: int | float | None = None,
    micro_batch: tuple[int, int] | None = None,
    checkpointing: bool | None = None,
    offload_activations: bool | None = None,
    tiled_loss: int | None = None,
    optimizer_type: str = "adamw",
    allow_low_precision_states: bool = False,
) -> Plan:
    """The least-offloaded stage × offload choice whose estimate fits, as ``initialize``
    keyword arguments, or an explanation of why none fits and what would.

    ``micro_batch``: (sequences, tokens) per GPU: the activations are then computed for the
    model (a Hugging Face Llama-kind model or the benchmark GPT: ``planning.estimate.activations``)
    and, for each choice, the cheapest activation measures that fit are picked
    (``planning.search.measures.ladder``: the tiled loss, checkpointing, both, both with activation
    offload); ``checkpointing``, ``offload_activations`` and ``tiled_loss`` (tokens a tile,
    0: off) fix one instead of leaving it to the planner. Checkpointing is the model's own
    switch (``plan.checkpointing``: call ``model.gradient_checkpointing_enable()``); the
    others are in ``kwargs``.

    ``gpu_memory``: bytes per GPU; ``host_memory`` and ``nvme_bytes``: bytes per node
    (``host_memory=None``: not checked, as if there were always enough).
    ``nvme_bytes=None`` with an ``nvme_path``: its free space is measured; with neither, NVMe
    space is not checked (NVMe choices are assumed to have room and say so); ``0``: no NVMe.
    ``headroom``: the fraction of every tier kept free (CUDA context, allocator
    fragmentation, the OS). ``activation_bytes`` per GPU; None leaves activations out.
    ``trainable_params``: with a parameter count, how many train (a LoRA fine-tune: the
    adapters; default all); only they have optimizer state and gradients. A model says it by
    its parameters' ``requires_grad``.

    ``optimizer_type``: the update rule (``adamw``, ``adam``, ``lion``, ``adagrad``). Each
    optimizer-state precision the kind offers gets a row (``Plan.states``: fp32; bf16
    moments; 8-bit moments; 8-bit moments with a bf16_kahan or a bf16_sr master) with its
    least-offloaded choice that fits. The plan takes fp32 state unless
    ``allow_low_precision_states``: then the highest precision whose choice needs the least
    offload (none, host memory, NVMe) of any row (``planning.search.precisions``); ``kwargs`` then
    carries its ``moment_precision`` and ``master_precision``.
    """
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    for name, value in (("gpu_memory", gpu_memory), ("host_memory", host_memory or 0)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    if nvme_bytes is None and nvme_path is not None:
        nvme_bytes = shutil.disk_usage(nvme_path).free
    shape = ModelShape.of(model_or_num_params, trainable_params)
    micro, rungs = micro_batch_for(
        model_or_num_params, micro_batch, activation_bytes, dtype,
        checkpointing, offload_activations, tiled_loss,
    )  # fmt: skip
    keep = 1 - headroom
    usable_gpu = gpu_memory * keep
    usable_host = None if host_memory is None else host_memory * keep
    limits: dict[str, float | None] = {
        "device": usable_gpu,
        "host": usable_host,
        "nvme": None if nvme_bytes is None else nvme_bytes * keep,
    }
    est_kwargs = dict(
        gpus_per_node=gpus_per_node,
        dtype=dtype,
        prefetch_depth=prefetch_depth,
        largest_layer_params=largest_layer_params,
        activation_bytes=activation_bytes,
        host_available=_UNCHECKED_HOST if host_memory is None else host_memory,
    )
    rows, chosen, est_kwargs, cands = _state_rows(
        shape, limits, num_gpus, est_kwargs, micro, rungs, optimizer_type,
        allow_low_precision_states,
    )  # fmt: skip
    state_line, notes = states_text(rows, chosen, allow_low_precision_states)
    if activation_bytes is None and micro is None:
        notes.append(
            "activations are not included: pass activation_bytes (rough rule with "
            "activation checkpointing: 2 × seq × batch × width × layers × 2 bytes)"
        )
    choice = next((c for c in cands if c.fits), None)
    trains = ""
    if trainable_params is not None or shape.trainable_params != shape.num_params:
        source = "trainable_params" if trainable_params is not None else "requires_grad"
        trains = (
            f" {describe_params(shape.num_params, shape.trainable_params, always=True)}"
            f": only the trainable ones ({source}) have optimizer state and gradients; "
            f"the frozen ones hold just their {_dtype_name(dtype)} copy."
        )
    outcome = functools.partial(
        Plan,
        candidates=tuple(cands),
        gpu_memory=int(gpu_memory),
        host_memory=None if host_memory is None else int(host_memory),
        nvme_bytes=None if nvme_bytes is None else int(nvme_bytes),
        headroom=headroom,
        states=tuple(rows),
        policy=chosen.policy,
        allow_low_precision_states=allow_low_precision_states,
    )
    if choice is None:
        lines = [
            f"nothing fits {num_gpus} × {_gb(gpu_memory)} GPUs with "
            + (
                "host memory not checked"
                if host_memory is None
                else f"{_gb(host_memory)} host memory per node"
            )
            + (
                f" and {_gb(nvme_bytes)} NVMe"
                if nvme_bytes
                else " and no NVMe"
                if nvme_bytes == 0
                else ""
            )
            + f" ({headroom:.0%} of each kept free)."
        ]
        last = cands[-1]
        lines.append(
            f"Even the most offloaded choice (stage 3, optimizer and params on NVMe) "
            f"fails: {'; '.join(last.reasons)}."
        )
        would = _what_would_fit(cands, limits, headroom, shape, num_gpus, est_kwargs, micro, rungs)
        if would:
            lines.append("What would fit: " + "; or ".join(would) + ".")
        if trains:
            lines.append(trains.strip())
        return outcome(
            fits=False, kwargs={}, choice=None, explanation="\n".join(lines), notes=tuple(notes)
        )
    kwargs: dict[str, Any] = {
        "stage": choice.stage,
        "offload_optimizer": choice.offload_optimizer,
        "offload_param": choice.offload_param,
        "dtype": _dtype_name(dtype),
    }
    if not chosen.policy.is_default:
        kwargs.update(policy_keys(chosen.policy))
    if choice.stage == 3:
        kwargs["prefetch_depth"] = prefetch_depth
    if choice.measures is not None:
        kwargs.update(choice.measures.kwargs())
    if choice.host_memory_limit is not None:
        kwargs["offload_optimizer_fraction"] = "auto"
        kwargs["host_memory_limit"] = choice.host_memory_limit
    if choice.uses_nvme:
        need = _gb(choice.estimate.nvme_bytes_per_node)
        if nvme_path is not None:
            kwargs["nvme_path"] = os.fspath(nvme_path)
        else:
            notes.append(
                f"add nvme_path=<a directory on a fast local disk> with {need} free "
                "per node"
                + (
                    " (NVMe space was not checked: pass nvme_bytes or nvme_path to check)"
                    if choice.nvme_unchecked
                    else ""
                )
            )
    skipped = [c for c in cands[: cands.index(choice)]]
    why = ""
    if skipped:
        prev = skipped[-1]
        why = (
            f" Less offloaded choices do not fit; the nearest, stage {prev.stage} with "
            f"optimizer {prev.offload_optimizer} and params {prev.offload_param}: "
            f"{'; '.join(prev.reasons)}."
        )
    e = choice.estimate
    explanation = (
        f"stage {choice.stage}, optimizer {choice.offload_optimizer}, params "
        f"{choice.offload_param} fits: GPU {_gb(e.gpu_bytes)} of "
        f"{_gb(usable_gpu)} usable, host {_gb(e.host_bytes_per_node)} "
        + ("(not checked)" if usable_host is None else f"of {_gb(usable_host)}")
        + f" per node, NVMe {_gb(e.nvme_bytes_per_node)} per "
        f"node.{split_text(choice)}{state_line}"
        f"{explain(choice.measures, choice.cheaper, micro)}{why}{trains}"
    )
    return outcome(
        fits=True, kwargs=kwargs, choice=choice, explanation=explanation, notes=tuple(notes)
    )
