"""Which ZeRO stage and offload choice fit a model on given GPUs, host memory and NVMe.

``estimate_memory`` (in :mod:`zero_offload.planning.estimate.memory`) computes what each rank
holds per tier; :func:`plan` tries every stage × offload choice from the least offloaded
(fastest) to the most, and returns the first that fits as keyword arguments for
``initialize`` — or, when none does, says why and what would (more GPU memory, host memory,
NVMe space or GPUs).

With the optimizer on NVMe, the host memory a choice leaves free is not wasted: the plan gives
it to the optimizer (``offload_optimizer_fraction="auto"`` with a ``host_memory_limit`` that
fills the node's usable host memory), so that many sub-groups stay in host memory and the
disk moves only the rest each step. The engine places them by the same rule
(``update.nvme.sizing.optimizer_split``).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ...memory.sizes import describe_params, dtype_name
from ...policies import Tier
from ..estimate.memory import (
    MemoryEstimate,
    ModelShape,
    Term,
    activation_memory,
    estimate_memory,
)
from .candidate import Candidate, Plan
from .choices import CHOICES, evaluate_states, what_would_fit
from .measures import explain, micro_batch_for
from .precisions import given_policy, policy_keys, states_text
from .reasons import gb as _gb
from .reasons import split_text

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

_UNCHECKED_HOST = 1 << 50  # host_memory=None: the budget of a node that is never short


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
    moment_precision: str | None = None,
    master_precision: str | None = None,
    fp32_moment_params: Sequence[str] = (),
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
    carries its ``moment_precision`` and ``master_precision``. ``moment_precision`` or
    ``master_precision`` given (the other fp32): the plan is for that state alone (one row).
    ``fp32_moment_params``: with 8-bit moments, the parameters whose moments stay fp32,
    counted so with a model (a parameter count has no names: they are counted quantized).
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
        Tier.DEVICE: usable_gpu,
        Tier.HOST: usable_host,
        Tier.NVME: None if nvme_bytes is None else nvme_bytes * keep,
    }
    est_kwargs: dict[str, Any] = dict(
        gpus_per_node=gpus_per_node,
        dtype=dtype,
        prefetch_depth=prefetch_depth,
        largest_layer_params=largest_layer_params,
        activation_bytes=activation_bytes,
        host_available=_UNCHECKED_HOST if host_memory is None else host_memory,
    )
    est_kwargs["fp32_moment_params"] = tuple(fp32_moment_params)
    given = given_policy(optimizer_type, moment_precision, master_precision)
    rows, chosen, est_kwargs, cands = evaluate_states(
        shape, limits, num_gpus, est_kwargs, micro, rungs, optimizer_type,
        allow_low_precision_states, given,
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
            f"the frozen ones hold just their {dtype_name(dtype)} copy."
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
        would = what_would_fit(cands, limits, headroom, shape, num_gpus, est_kwargs, micro, rungs)
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
        "dtype": dtype_name(dtype),
    }
    if not chosen.policy.is_default:
        kwargs.update(policy_keys(chosen.policy))
    if choice.estimate.sharding.shards_params:
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
