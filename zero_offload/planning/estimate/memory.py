"""What one rank holds, per tier, for a stage × offload choice — computed, not measured.

The estimate follows the engine's own arithmetic (``Engine.memory_report`` counts the same
buffers from real tensors), so it can be checked against the ledger: every unit is padded to a
multiple of ``num_shards × SHARD_ALIGN`` elements, the fp32 master + Adam m + v are 12 bytes per
element of the rank's shard ``S``, offloaded gradients are fp32 on the host, and so on. Every
count and rule the engine has (buffers per pool, reductions in flight, padding, the host budget
split, how a pool fits its budget) comes from the component that owns it: its sizing function
or constant, which its constructor calls too; this module only adds them up (the terms are
built in ``terms``). Each term says which tier it lives in, when it is alive (held
between steps, or only during forward/backward or the step) and whether it is one of ZeRO's
*model states* (params, grads, optimizer state: the paper's arithmetic) or an engine buffer /
activations on top.

Given a model (the meta device is fine: only shapes are read) the units are laid out exactly as
the engine lays them out (``plan_units``: frozen parameters in units of their own); given a
parameter count, padding is ignored. Optimizer state and gradients cover only the trainable
parameters (``requires_grad``, or ``trainable_params`` with a count); frozen ones hold just
their compute-dtype copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn

from ...config import ConfigError
from ...config.checks import number
from ...grads.host import staging_bytes
from ...memory.sizes import activation_memory
from ...memory.sizes import dtype_bytes as _dtype_bytes
from ...memory.sizes import dtype_name as _dtype_name
from ...memory.sizes import pool_bytes as _pool
from ...optim.policy import StatePolicy
from ...params.sizing import param_pool_buffers, units_per_sub_group
from ...policies import OFFLOAD_KEYWORDS, Stage, Tier
from ...swap.budget import activation_host_share, host_memory_budget, split_host_budget
from ...update.nvme.sizing import full_group
from .activations import ActivationEstimate
from .builder import TermBuilder
from .result import TIERS, MemoryEstimate
from .shape import ModelShape, count_layout, model_layout
from .state import FP32_STATE, state_policy, state_rate, state_split
from .terms import (
    ACTIVATIONS,
    BUFFER,
    FORWARD_BACKWARD,
    INITIALIZE,
    LOSS,
    MODEL_STATE,
    REDUCE,
    RESIDENT,
    STEP,
    HostSplit,
    Layout,
    Term,
)

__all__ = [
    "Term",
    "TIERS",
    "MemoryEstimate",
    "ModelShape",
    "estimate_memory",
    "activation_memory",
    "RESIDENT",
    "FORWARD_BACKWARD",
    "LOSS",
    "REDUCE",
    "STEP",
    "INITIALIZE",
    "MODEL_STATE",
    "BUFFER",
    "ACTIVATIONS",
]


def _parse_choice(
    stage: int, offload_optimizer: str, offload_param: str
) -> tuple[Stage, Tier, Tier]:
    """The keywords, parsed once: what the stage shards and where each state lives."""
    try:
        sharding = Stage(stage)
    except ValueError:
        raise ConfigError(f"stage={stage!r} is not valid: expected 0, 1, 2 or 3") from None
    tiers = []
    for key, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value not in OFFLOAD_KEYWORDS:
            raise ConfigError(f"{key}={value!r} is not valid: expected 'none', 'cpu' or 'nvme'")
        tiers.append(Tier.from_keyword(value))
    optimizer_tier, param_tier = tiers
    if param_tier.offloaded and not sharding.shards_params:
        raise ConfigError(f"offload_param={offload_param!r} needs stage=3 (got stage={stage})")
    if optimizer_tier.offloaded and not sharding.shards_optimizer:
        raise ConfigError(f"offload_optimizer={offload_optimizer!r} needs stage 1, 2 or 3")
    return sharding, optimizer_tier, param_tier


def estimate_memory(
    model_or_num_params: nn.Module | int | float | ModelShape,
    *,
    num_gpus: int,
    gpus_per_node: int | None = None,
    stage: int,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    prefetch_depth: int = 2,
    largest_layer_params: int | None = None,
    activation_bytes: int | None = None,
    activations: ActivationEstimate | None = None,
    reduce_bucket_size: int = 25_000_000,
    sub_group_size: int = 100_000_000,
    host_memory_limit: int | None = None,
    device: str = "cuda",
    trainable_params: int | float | None = None,
    host_available: int | None = None,
    offload_optimizer_fraction: float | str | None = None,
    offload_param_fraction: float | None = None,
    gradient_accumulation_steps: int = 1,
    step_during_backward: bool = True,
    optimizer_type: str = "adamw",
    moment_precision: str = "fp32",
    master_precision: str = "fp32",
    fp32_moment_params: Iterable[str] = (),
) -> MemoryEstimate:
    """Bytes each rank holds in each tier for this configuration, term by term.

    ``model_or_num_params``: a module (meta device fine; the engine's unit layout and padding
    are reproduced exactly) or a parameter count (no padding). ``largest_layer_params``:
    stage 3's largest module, gathered ``prefetch_depth + 1`` at a time (default: read from
    the model, else Ψ/50). ``gpus_per_node``: default min(num_gpus, 8). ``activation_bytes``:
    per GPU, alive with everything else of forward/backward; None leaves activations out.
    ``activations``: instead, ``planning.estimate.activations.estimate_activations``'s
    figures: those of the layers and the head beside the gathered window and the reductions
    in flight, those of the loss without them, and activation offload's host buffers (which
    then come out of the host budget first, as the engine takes them). ``device="cpu"`` models the
    engine on a CPU-only machine, where the CPU is the "device" tier (as ``memory_report``
    names it).
    ``trainable_params``: with a parameter count, how many train (default: all; a LoRA run
    trains a few million of billions); a model says it by ``requires_grad``. Only those have
    optimizer state and gradients; frozen ones keep their compute-dtype params.
    ``host_available``: the node's host memory the default ``host_memory_limit`` is taken
    from (default: this machine's available memory now), as ``swap.budget`` says.
    ``offload_optimizer_fraction``: with the optimizer on NVMe, the share of its state in
    files (whole sub-groups of the rest stay in host memory), or "auto" (fill the optimizer's
    share of the host budget first), as the engine places it.
    ``offload_param_fraction``: stage 3 with the params on NVMe, the share of the parameter
    shards in files (whole units; the leading ones stay in host memory).
    ``gradient_accumulation_steps``: above 1, stages 2-3 sum offloaded gradients in fp32.
    ``step_during_backward``: as the engine's keyword; pass False with ``max_grad_norm`` set,
    where the engine steps nothing during backward (nor does it with float16).
    ``optimizer_type``, ``moment_precision``, ``master_precision``: the config keywords of
    the same names (``optim.policy.StatePolicy``): the optimizer state's bytes per element,
    in whichever tier it lives, its NVMe files and the disk traffic per step follow them.
    ``fp32_moment_params``: with 8-bit moments, the parameters whose moments stay fp32
    (counted so with a model; a parameter count has no names and counts them quantized).
    """
    offload_optimizer = offload_optimizer or "none"
    offload_param = offload_param or "none"
    sharding, optimizer_tier, param_tier = _parse_choice(stage, offload_optimizer, offload_param)
    if activation_bytes and activations is not None:
        raise ValueError("give activation_bytes or activations, not both")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    _check_numbers(locals())
    policy = state_policy(optimizer_type, moment_precision, master_precision, fp32_moment_params)
    shape = ModelShape.of(model_or_num_params, trainable_params)
    b = _dtype_bytes(dtype)
    shards = num_gpus if sharding.sharded else 1
    key = (stage, num_gpus, b, prefetch_depth, largest_layer_params, reduce_bucket_size)
    if shape.model is not None and key in shape.layouts:
        layout = shape.layouts[key]
    elif shape.model is not None:
        layout = shape.layouts[key] = model_layout(
            shape.model,
            stage=sharding,
            num_gpus=num_gpus,
            shards=shards,
            b=b,
            prefetch_depth=prefetch_depth,
            largest_layer_params=largest_layer_params,
            reduce_bucket_size=reduce_bucket_size,
        )
    else:
        layout = count_layout(
            shape,
            stage=sharding,
            shards=shards,
            b=b,
            prefetch_depth=prefetch_depth,
            largest_layer_params=largest_layer_params,
            reduce_bucket_size=reduce_bucket_size,
        )
    gpus_per_node = min(gpus_per_node or 8, num_gpus)  # a node holds at most them all
    host = _split_host(
        layout,
        b=b,
        shards=shards,
        prefetch_depth=prefetch_depth,
        host_memory_limit=host_memory_limit,
        host_available=host_available,
        ranks=gpus_per_node,
        optimizer_tier=optimizer_tier,
        param_tier=param_tier,
        on_cpu=device == "cpu",
        sub_group_size=sub_group_size,
        offload_optimizer_fraction=offload_optimizer_fraction,
        offload_activations=activations is not None and activations.offload,
        policy=policy,
    )
    build = TermBuilder(
        num_params=shape.num_params,
        trainable_params=shape.trainable_params,
        sharding=sharding,
        optimizer_tier=optimizer_tier,
        param_tier=param_tier,
        device=device,
        b=b,
        shards=shards,
        layout=layout,
        host=host,
        gradient_accumulation_steps=gradient_accumulation_steps,
        step_during_backward=step_during_backward and _dtype_name(dtype) != "float16",
        policy=policy,
    )
    build.add_params(prefetch_depth, offload_param_fraction)
    build.add_grads()
    build.add_unit_being_made()
    build.add_optimizer()
    if activation_bytes:
        build.add("activations", "device", FORWARD_BACKWARD, ACTIVATIONS, activation_bytes, "given")
    if activations is not None:
        # stage 3 gathers the head for its backward: the largest unit, for Llama and GPT
        head = b * layout.largest if sharding.shards_params else 0
        build.terms.extend(activations.terms(head_gathered=head))
    return _estimate(build, num_gpus, gpus_per_node, _dtype_name(dtype))


_LOWEST = {  # the keywords initialize checks, and their least values
    "prefetch_depth": 0,
    "gradient_accumulation_steps": 1,
    "host_memory_limit": 1,
    "gpus_per_node": 1,
    "activation_bytes": 0,
    "largest_layer_params": 0,
}


def _check_numbers(kw: dict[str, object]) -> None:
    """A ConfigError naming the key for a value ``initialize`` (or arithmetic) refuses."""
    for key, lo in _LOWEST.items():
        if kw[key] is not None:
            number(key, kw[key], lo=lo, integer=key != "activation_bytes")
    for key in ("offload_optimizer_fraction", "offload_param_fraction"):
        if kw[key] is not None and kw[key] != "auto":
            number(key, kw[key], lo=0.0, hi=1.0)


def _estimate(build: TermBuilder, num_gpus: int, gpus_per_node: int, dtype: str) -> MemoryEstimate:
    """The terms ``build`` added, with the configuration they were made for."""
    nvme = build.optimizer_tier.on_nvme
    return MemoryEstimate(
        num_params=build.num_params,
        trainable_params=build.trainable_params,
        num_gpus=num_gpus,
        gpus_per_node=gpus_per_node,
        stage=build.sharding.number,
        offload_optimizer=build.optimizer_tier.keyword,
        offload_param=build.param_tier.keyword,
        dtype=dtype,
        shard_numel=build.layout.s,
        trainable_shard_numel=build.layout.s_t,
        device=build.device,
        terms=tuple(build.terms),
        nvme_fraction=build.host.split.nvme_fraction if nvme else None,
        disk_bytes_per_step=build.host.split.disk_bytes_per_step() if nvme else 0,
        host_budget=build.host.budget,
        policy=build.policy,
    )


def _split_host(
    layout: Layout,
    *,
    b: int,
    shards: int,
    prefetch_depth: int,
    host_memory_limit: int | None,
    host_available: int | None,
    ranks: int,
    optimizer_tier: Tier,
    param_tier: Tier,
    on_cpu: bool,
    sub_group_size: int,
    offload_optimizer_fraction: float | str | None,
    offload_activations: bool = False,
    policy: StatePolicy = FP32_STATE,
) -> HostSplit:
    """One host budget per rank, split between the pools as the engine splits it (offloaded
    activations' share first: ``swap.budget.activation_host_share``)."""
    budget = host_memory_budget(host_memory_limit, available=host_available, ranks=ranks)
    staging = (
        staging_bytes(math.ceil(layout.largest_t / shards), b)
        if optimizer_tier.offloaded and not on_cpu
        else 0
    )
    param_buffers = param_pool_buffers(
        prefetch_depth,
        optimizer_tier.on_nvme,
        _update_writes(layout, shards, sub_group_size) if optimizer_tier.on_nvme else 0,
    )
    param_pool = _pool(b * math.ceil(layout.largest / shards), param_buffers, None)
    acts = (
        activation_host_share(budget, param_tier, optimizer_tier, staging)
        if offload_activations
        else 0
    )
    param_budget, opt_budget = split_host_budget(
        budget - acts, param_pool, param_tier, optimizer_tier, staging
    )
    split = state_split(
        policy,
        layout.s_t,
        sub_group_size,
        opt_budget,
        b,
        offload_optimizer_fraction if optimizer_tier.on_nvme else None,
        state_rate(policy, layout.plans),
    )
    return HostSplit(budget, staging, param_budget, split, param_buffers)


def _update_writes(layout: Layout, shards: int, sub_group_size: int) -> int:
    """Units one sub-group's step of the NVMe optimizer puts at once, as the engine counts
    them (``engine.parts.update_writes``); for a parameter count, units of the largest
    trainable module's shard back to back."""
    group = full_group(layout.s_t, sub_group_size)
    if layout.plans is not None:
        trained = [(p.shard_offset, p.shard_numel) for p in layout.plans if not p.frozen]
    else:
        size = max(1, math.ceil(layout.largest_t / shards))
        trained = [(k * size, size) for k in range(-(-layout.s_t // size))]
    return units_per_sub_group(trained, group)
