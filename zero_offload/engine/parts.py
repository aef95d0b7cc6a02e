"""Building an engine's parts around the model, each from the ones it depends on, and the
objects the engine is composed of around them (:func:`compose`): the forward driver, the
lifecycle, the step driver and the state view, which share the parts.

What the parts run on besides the model and its configuration (:class:`Runtime`): the device's
side streams, the worker that sums reduced gradient shards on the host and the device optimizer;
``initialize`` takes the real ones, a rehearsal (``zero_offload.rehearsal``) passes simulated
ones.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..activations.wiring import build_offload
from ..comm import Comm
from ..config import ZeroConfig
from ..deepspeed_config import schedule
from ..device import placement
from ..device.streams import Streams
from ..device.threads import ThreadBudget
from ..grads.host import HostGradQueue, host_grad_dtype, staging_bytes
from ..grads.reducer import GradReducer
from ..grads.target import GradTarget, ResidentGrads
from ..params.gather import ParamGatherer
from ..params.sizing import param_host_numel, param_pool_bytes, units_per_sub_group
from ..params.store import ParamStore
from ..params.unit_state import UnitStates
from ..params.units import UnitPlan, plan_units, trainable_numel
from ..swap.budget import activation_host_share, host_memory_budget
from ..swap.budget import split_host_budget as split_budget
from ..update.factory import make_updater, params_are_master
from ..update.host_state import run_layout
from ..update.nvme.sizing import full_group
from ..update.stepper import ShardStepper
from ..update.window import WindowCoordinator
from ..weak import weak_hook
from .build import Leftovers, Parts, build_units
from .forward import ForwardDriver, ForwardWindow
from .lifecycle import Lifecycle
from .optimizer_state import attach_state_dict
from .preemption import Preemption
from .state import StateView
from .steps import StepDriver, StepRecord
from .weights import broadcast_buffers, load_buffers, open_pretrained

__all__ = ["Composed", "Runtime", "build_parts", "compose", "split_host_budget"]

log = logging.getLogger(__name__)


@dataclass
class Composed:
    """The objects an engine is composed of, each holding only what it needs, and what they
    run on."""

    comm: Comm
    device: torch.device
    threads: ThreadBudget  # threads per kind of CPU work, decided once for this rank
    streams: Streams
    parts: Parts  # shared: close() releases them once, for every object below
    record: StepRecord  # the steps counted and what the last one did
    window: ForwardWindow
    lifecycle: Lifecycle
    steps: StepDriver
    state: StateView
    forward: ForwardDriver
    preemption: Preemption | None


def compose(
    model: nn.Module,
    config: ZeroConfig,
    runtime: Runtime,
    leftovers: Leftovers,
    finalizer: Callable[[], object],
) -> Composed:
    """The parts around ``model`` (:func:`build_parts`) on the device and threads chosen for
    this rank, and the engine's objects around them; ``finalizer`` releases ``leftovers``
    however the engine ends."""
    comm = Comm(config.process_group)
    device = placement.select_device(config.device)
    placement.warn_if_slow_on_cpu(device, config.dtype)
    threads = ThreadBudget.decide(device.type, config.threads)
    threads.apply_compute()
    streams = runtime.streams(device)
    parts = build_parts(model, config, comm, device, threads, streams, runtime, leftovers)
    record = StepRecord()
    window = ForwardWindow()
    lifecycle = Lifecycle(model, config, comm, parts, window.end_interrupted, leftovers, finalizer)
    steps = StepDriver(config, comm, parts, lifecycle, record, lr_scheduler=None)
    state = StateView(
        model, config, comm, device, streams, parts, record, lifecycle, steps.zero_grad
    )
    forward = ForwardDriver(model, config, comm, device, parts, lifecycle, window, record)
    attach_state_dict(state)  # engine.optimizer.state_dict() holds the state of every tier
    # a DeepSpeed config's lr schedule, stepped after each applied update as DeepSpeed does
    steps.lr_scheduler = schedule(state.optimizer, config.lr_schedule)
    # save_on_preemption: SIGTERM/SIGINT end the run at an agreed step (engine.preemption)
    preemption = Preemption(comm, device) if config.save_on_preemption else None
    if preemption is not None:
        leftovers.closers.append(preemption.close)
    # model(x) is engine(x): the window opens before the root's other pre-forward hooks
    leftovers.closers[:0] = window.hook_root(model, weak_hook(forward.root_pre_forward))
    log.info(
        "zero_offload: stage %d, %d units, rank %d/%d, %s on %s",
        config.stage,
        len(parts.units),
        comm.rank,
        comm.world_size,
        config.precision.dtype,
        device,
    )
    return Composed(
        comm,
        device,
        threads,
        streams,
        parts,
        record,
        window,
        lifecycle,
        steps,
        state,
        forward,
        preemption,
    )


def split_host_budget(
    config: ZeroConfig, plans: list[UnitPlan], device: torch.device, dtype: torch.dtype
) -> tuple[int, int, int]:
    """This rank's one host budget (``swap.budget``): the gradient staging buffers first
    (CUDA), then offloaded activations (``offload_activations``), then the NVMe parameter
    pool (at most half of the rest when it shares with the NVMe optimizer), the rest for the
    optimizer with its gradients: (param pool, optimizer, activations)."""
    off = config.offload
    staging = 0
    if off.optimizer_tier.offloaded and device.type == "cuda":
        largest = max((p.shard_numel for p in plans if not p.frozen), default=0)
        staging = staging_bytes(largest, torch.empty(0, dtype=dtype).element_size())
    pool = param_pool_bytes(
        config, max((p.shard_numel for p in plans), default=0), dtype, update_writes(config, plans)
    )
    budget = host_memory_budget(off.host_memory_limit)
    acts = (
        activation_host_share(budget, off.param_tier, off.optimizer_tier, staging)
        if config.activations.offload
        else 0
    )
    return (
        *split_budget(budget - acts, pool, off.param_tier, off.optimizer_tier, staging),
        acts,
    )


def update_writes(config: ZeroConfig, plans: list[UnitPlan]) -> int:
    """Units whose new shards one sub-group's step of the NVMe optimizer puts at once (0:
    the optimizer is not on NVMe): the parameter pool's write-backs are sized to it."""
    if not config.offload.optimizer_tier.on_nvme:
        return 0
    group = full_group(trainable_numel(plans), config.offload.sub_group_size)
    return units_per_sub_group(
        [(p.shard_offset, p.shard_numel) for p in plans if not p.frozen], group
    )


def build_parts(
    model: nn.Module,
    config: ZeroConfig,
    comm: Comm,
    device: torch.device,
    threads: ThreadBudget,
    streams: Streams,
    runtime: Runtime,
    leftovers: Leftovers,
) -> Parts:
    """The parts around ``model`` (moved to ``device``, pretrained weights loaded); what must
    be released however the engine ends goes to ``leftovers``."""
    stage = config.sharding  # what the stage shards
    dtype = config.precision.dtype
    placement.move_model(model, device, stage)
    if config.broadcast_buffers:
        broadcast_buffers(model, comm)
    plans = plan_units(
        model,
        stage=stage,
        world_size=comm.world_size,
        bucket_size=config.reduce_bucket_size,
    )
    weights = open_pretrained(config.init_weights, model, plans) if config.init_weights else None
    shard_numel = sum(p.shard_numel for p in plans)
    param_budget, optimizer_budget, activation_budget = split_host_budget(
        config, plans, device, dtype
    )
    param_store = (
        ParamStore(
            config,
            shard_numel,
            max((p.shard_numel for p in plans), default=0),
            dtype,
            device,
            comm.rank,
            param_budget,
            streams,
            param_host_numel(
                [(p.shard_offset, p.shard_numel) for p in plans], config.offload.param_fraction
            ),
            threads.io,
            update_writes(config, plans),
        )
        if stage.shards_params
        else None
    )
    if param_store is not None:
        leftovers.closers.append(param_store.close)
    # optimizer state and gradients cover the trainable prefix of the rank-flat shard
    trainable = trainable_numel(plans)
    # stage 0 with fp32 compute: the params live in one rank-flat buffer that is the master
    flat_params = (
        torch.empty(trainable, dtype=torch.float32, device=device)
        if params_are_master(config, dtype)
        else None
    )
    updater = make_updater(
        trainable,
        config,
        device,
        dtype,
        comm.rank,
        param_store.resident if param_store else flat_params,
        optimizer_budget,
        threads,
        runtime.device_optimizer,
        run_layout(config.optimizer.policy, plans, comm.rank),
    )
    leftovers.closers.append(updater.close)
    units = build_units(
        model,
        plans,
        config,
        comm,
        device,
        updater,
        param_store,
        weights,
        leftovers,
        flat_params,
    )
    if weights is not None:
        load_buffers(model, *weights)
        if config.broadcast_buffers:
            broadcast_buffers(model, comm)
        weights[0].close()
    grad_queue: HostGradQueue | None = None
    grads: torch.Tensor | None = None  # None: the optimizer keeps them in files
    widened: ResidentGrads | None = None  # a host shard that may become fp32
    target: GradTarget
    if not config.offload.optimizer_tier.offloaded:
        grads = torch.zeros(trainable, dtype=dtype, device=device)
        target = ResidentGrads(grads)
    else:  # copied and summed in the background while backward runs on
        host_target: GradTarget
        if updater.disk_grads is not None:  # in files beside the optimizer's state
            host_target = updater.disk_grads
        else:  # the optimizer steps on the host: reduced gradient shards go there
            grads = torch.zeros(
                trainable,
                dtype=host_grad_dtype(  # never crosses PCIe
                    stage, config.gradient_accumulation_steps, dtype
                ),
            )
            host_target = widened = ResidentGrads(grads)
        worker = runtime.host_worker
        grad_queue = HostGradQueue(
            host_target,
            streams,
            max((p.shard_numel for p in plans if not p.frozen), default=0),
            dtype,
            threads=threads,
            worker=worker() if worker is not None else None,
        )
        leftovers.closers.insert(0, grad_queue.close)  # before the updater
        target = grad_queue
    unit_states = UnitStates(units, comm, streams)
    gatherer = (
        ParamGatherer(
            model,
            units,
            unit_states,
            param_store,
            prefetch_depth=config.prefetch_depth,
            prefetch_bytes=config.prefetch_bytes,
        )
        if param_store
        else None
    )
    reducer = GradReducer(
        units,
        unit_states,
        comm,
        stage,
        target,
        on_reduced=gatherer.release if gatherer else None,
    )
    leftovers.closers[:0] = [reducer.remove_hooks] + ([gatherer.remove_hooks] if gatherer else [])
    activations = build_offload(config, model, units, streams, gatherer, activation_budget)
    coordinator = WindowCoordinator()
    stepper = ShardStepper(
        units,
        config,
        comm,
        grads,
        device,
        dtype,
        updater,
        param_store,
        streams,
        coordinator,
    )
    # an update still running under a forward stops first, while its files are open;
    # the pinned staging buffers go last, once nothing copies from them any more
    leftovers.closers.insert(0, coordinator.abandon)
    leftovers.closers += [stepper.sink.release_staging]
    if activations is not None:
        leftovers.closers.append(activations.close)
    leftovers.closers.append(streams.close)
    parts = Parts(
        param_store,
        trainable,
        shard_numel,
        units,
        grads,
        grad_queue,
        unit_states,
        gatherer,
        reducer,
        activations,
        stepper,
        coordinator,
    )
    if widened is not None:  # weak: the target must not keep the parts alive
        widened.on_widen = weak_hook(parts.widen_grads)
    return parts


@dataclass(frozen=True)
class Runtime:
    """The machine-facing parts of one engine (each default is the real one)."""

    # the side streams of the compute device (their calls run inline on a CPU device)
    streams: Callable[[torch.device], Streams] = Streams
    # runs the host-side gradient sums in order; None: a thread of the engine's own
    host_worker: Callable[[], Executor] | None = None
    # builds the optimizer of a device-resident master; None: torch's fused AdamW
    device_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None
