"""The training engine: ZeRO stages 0–3 around an ordinary ``torch.nn.Module``.

``initialize(model, **kwargs)`` validates the configuration, flattens the model's parameters
into units (``params.units``), and wires three parts together: the gradient reducer
(``grads.reducer``), the sharded optimizer (``update.stepper``) and, in stage 3, the parameter
gatherer (``params.gather``). The model's own parameters become views into the units' flat
buffers, so the user's module runs unchanged. Closing and lending parameters their values
live in ``engine.lifecycle``, the accessors checkpoints and users read in
``engine.state``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import Any, Callable, ContextManager, Iterator, Mapping

import torch
import torch.nn as nn

from ..activations.wiring import build_offload, forward_context
from ..comm import Comm
from ..config import ZeroConfig, build_config
from ..deepspeed_config import schedule
from ..device import placement
from ..device.threads import ThreadBudget
from ..grads.host import HostGradQueue, host_grad_dtype, staging_bytes
from ..grads.reducer import GradReducer
from ..grads.target import GradTarget, ResidentGrads
from ..interrupts import signals_held
from ..memory.ledger import MemoryReport
from ..params.gather import ParamGatherer
from ..params.store import ParamStore, param_host_numel, param_pool_bytes
from ..params.unit_state import UnitStates
from ..params.units import FlatUnit, UnitPlan, persistent_buffers, plan_units, trainable_numel
from ..swap.budget import (
    activation_host_share,
    host_memory_budget,
    return_freed_memory,
    split_host_budget,
)
from ..update.host_state import run_layout
from ..update.stepper import ShardStepper
from ..update.updaters import make_updater, params_are_master
from ..weak import weak_hook
from . import export
from .buffer_sync import broadcast_buffers
from .build import build_units
from .forward import ForwardWindow
from .handback import Leftovers, check_parameters
from .inputs import move_inputs
from .lifecycle import EngineLifecycle
from .optimizer_state import attach_state_dict
from .preemption import Preemption, exit_status
from .runtime import Runtime
from .state import EngineState
from .step_stats import StepClock, optimizer_stats, summarize
from .weights import load_buffers, open_pretrained

__all__ = ["Engine", "initialize", "persistent_buffers"]

log = logging.getLogger(__name__)


def _split_host_budget(
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
    pool = param_pool_bytes(config, max((p.shard_numel for p in plans), default=0), dtype)
    budget = host_memory_budget(off.host_memory_limit)
    acts = (
        activation_host_share(budget, off.param_tier, off.optimizer_tier, staging)
        if config.activations.offload
        else 0
    )
    return (
        *split_host_budget(budget - acts, pool, off.param_tier, off.optimizer_tier, staging),
        acts,
    )


class Engine(EngineLifecycle, EngineState):
    """Runs forward/backward/step of one data-parallel rank. Build it with :func:`initialize`."""

    def __init__(
        self, model: nn.Module, config: ZeroConfig, runtime: Runtime | None = None
    ) -> None:
        """``runtime``: the machine-facing parts (side streams, the host gradient worker, the
        device optimizer); None: the real ones. A rehearsal passes simulated ones."""
        self.config = config
        self._runtime = runtime = runtime or Runtime()
        self._closed = True  # until checked
        check_parameters(model)
        self.comm = Comm(config.process_group)
        self.device = placement.select_device(config.device)
        # threads per kind of CPU work, decided once for this rank (device.threads)
        self.threads = ThreadBudget.decide(self.device.type, config.threads)
        self.threads.apply_compute()
        self.dtype = config.precision.dtype
        self.stage = config.stage
        self.sharding = config.sharding  # what the stage shards, for the parts
        self._module = model
        self.streams = runtime.streams(self.device)
        # What must be released however this engine ends (close(), collection, exit, or an
        # error below); it holds nothing that refers back to the engine.
        self._leftovers = Leftovers()
        self._finalizer = weakref.finalize(self, self._leftovers.release)
        self._closed = False
        try:
            self._build(model, config)
        except BaseException:
            self._closed = True  # a half-built engine is not usable
            self._finalizer()
            raise

    def _build(self, model: nn.Module, config: ZeroConfig) -> None:
        placement.move_model(model, self.device, self.sharding)
        if config.broadcast_buffers:
            broadcast_buffers(model, self.comm)
        plans = plan_units(
            model,
            stage=self.sharding,
            world_size=self.comm.world_size,
            bucket_size=config.reduce_bucket_size,
        )
        self._weights = (
            open_pretrained(config.init_weights, model, plans) if config.init_weights else None
        )
        shard_numel = sum(p.shard_numel for p in plans)
        param_budget, optimizer_budget, activation_budget = _split_host_budget(
            config, plans, self.device, self.dtype
        )
        self.param_store = (
            ParamStore(
                config,
                shard_numel,
                max((p.shard_numel for p in plans), default=0),
                self.dtype,
                self.device,
                self.comm.rank,
                param_budget,
                self.streams,
                param_host_numel(
                    [(p.shard_offset, p.shard_numel) for p in plans], config.offload.param_fraction
                ),
                self.threads.io,
            )
            if self.sharding.shards_params
            else None
        )
        if self.param_store is not None:
            self._leftovers.closers.append(self.param_store.close)
        # optimizer state and gradients cover the trainable prefix of the rank-flat shard
        self.trainable_numel = trainable = trainable_numel(plans)
        # stage 0 with fp32 compute: the params live in one rank-flat buffer that is the master
        flat_params = (
            torch.empty(trainable, dtype=torch.float32, device=self.device)
            if params_are_master(config, self.dtype)
            else None
        )
        updater = make_updater(
            trainable,
            config,
            self.device,
            self.dtype,
            self.comm.rank,
            self.param_store.resident if self.param_store else flat_params,
            optimizer_budget,
            self.threads,
            self._runtime.device_optimizer,
            run_layout(config.optimizer.policy, plans, self.comm.rank),
        )
        self._leftovers.closers.append(updater.close)
        self.units = build_units(
            model,
            plans,
            config,
            self.comm,
            self.device,
            updater,
            self.param_store,
            self._weights,
            self._leftovers,
            flat_params,
        )
        if self._weights is not None:
            load_buffers(model, *self._weights)
            if config.broadcast_buffers:
                broadcast_buffers(model, self.comm)
            self._weights[0].close()
            self._weights = None
        self.grad_queue: HostGradQueue | None = None
        self.grads: torch.Tensor | None = None  # None: the optimizer keeps them in files
        target: GradTarget
        if not config.offload.optimizer_tier.offloaded:
            self.grads = torch.zeros(trainable, dtype=self.dtype, device=self.device)
            target = ResidentGrads(self.grads)
        else:  # copied and summed in the background while backward runs on
            host_target: GradTarget
            if updater.disk_grads is not None:  # in files beside the optimizer's state
                host_target = updater.disk_grads
            else:  # the optimizer steps on the host: reduced gradient shards go there
                self.grads = torch.zeros(
                    trainable,
                    dtype=host_grad_dtype(  # never crosses PCIe
                        self.sharding, config.gradient_accumulation_steps, self.dtype
                    ),
                )
                host_target = ResidentGrads(  # weak: the target must not keep the engine alive
                    self.grads, on_widen=weak_hook(self._host_grads_widened)
                )
            worker = self._runtime.host_worker
            self.grad_queue = HostGradQueue(
                host_target,
                self.streams,
                max((p.shard_numel for p in plans if not p.frozen), default=0),
                self.dtype,
                threads=self.threads,
                worker=worker() if worker is not None else None,
            )
            self._leftovers.closers.insert(0, self.grad_queue.close)  # before the updater
            target = self.grad_queue
        self.shard_numel = shard_numel
        self.unit_states = UnitStates(self.units, self.comm, self.streams)
        self.gatherer = (
            ParamGatherer(
                model,
                self.units,
                self.unit_states,
                self.param_store,
                prefetch_depth=config.prefetch_depth,
                prefetch_bytes=config.prefetch_bytes,
            )
            if self.param_store
            else None
        )
        self.reducer = GradReducer(
            self.units,
            self.unit_states,
            self.comm,
            self.sharding,
            target,
            on_reduced=self.gatherer.release if self.gatherer else None,
        )
        self._leftovers.closers[:0] = [self.reducer.remove_hooks] + (
            [self.gatherer.remove_hooks] if self.gatherer else []
        )
        self.activations = build_offload(
            config, model, self.units, self.streams, self.gatherer, activation_budget
        )
        self.stepper = ShardStepper(
            self.units,
            config,
            self.comm,
            self.grads,
            self.device,
            self.dtype,
            updater,
            self.param_store,
            self.streams,
        )
        # an update still running under a forward stops first, while its files are open;
        # the pinned staging buffers go last, once nothing copies from them any more
        self._leftovers.closers.insert(0, self.stepper.abandon)
        self._leftovers.closers += [self.stepper.sink.release_staging]
        if self.activations is not None:
            self._leftovers.closers.append(self.activations.close)
        self._leftovers.closers.append(self.streams.close)
        attach_state_dict(self)  # engine.optimizer.state_dict() holds the state of every tier
        # a DeepSpeed config's lr schedule, stepped after each applied update as DeepSpeed does
        self.lr_scheduler = schedule(self.optimizer, config.lr_schedule)
        # save_on_preemption: SIGTERM/SIGINT end the run at an agreed step (engine.preemption)
        self.preemption = Preemption(self.comm, self.device) if config.save_on_preemption else None
        if self.preemption is not None:
            self._leftovers.closers.append(self.preemption.close)
        self.micro_steps = 0
        self.global_steps = 0
        self._last_comm: dict = {}
        self._last_step_peak = 0  # stage 3: peak gathered param bytes of the last step
        self._first_boundary_passed = False  # see step(): its freed pages go back once
        self.clock = StepClock()
        self.last_step: dict[str, float] = {}  # what the last step did (step_stats.summarize)
        self._lending = False  # gathered_parameters(): forwards inside it open no window
        self._window = ForwardWindow(weak_hook(self._forward_context))
        self._hook_root(model)
        log.info(
            "zero_offload: stage %d, %d units, rank %d/%d, %s on %s",
            self.stage,
            len(self.units),
            self.comm.rank,
            self.comm.world_size,
            self.dtype,
            self.device,
        )

    def _hook_root(self, model: nn.Module) -> None:
        """``model(x)`` becomes ``engine(x)``: the window opens before every other pre-forward
        hook of the root and closes after its other post-forward hooks (stage 3's release)."""
        handles = [
            model.register_forward_pre_hook(
                weak_hook(self._root_pre_forward), prepend=True, with_kwargs=True
            ),
            model.register_forward_hook(weak_hook(self._window.after_root)),
            model.register_forward_hook(
                weak_hook(self._window.after_root_raised), always_call=True
            ),
        ]
        self._leftovers.closers[:0] = [h.remove for h in handles]

    def _root_pre_forward(
        self, _module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        if self._closed or self._lending:
            return None
        self._window.before_root()
        return move_inputs(args, self.device, self.dtype), move_inputs(
            kwargs, self.device, self.dtype
        )

    @contextlib.contextmanager
    def _forward_context(self) -> Iterator[None]:
        """What one forward window holds: the engine's checks, rank 0's buffers taken while
        training, stage 3's gathers and the activations' hooks, the clock's forward phase."""
        self._check_open(settle=False)  # an update left running goes on unit by unit
        if self.config.broadcast_buffers and self._module.training:
            broadcast_buffers(self._module, self.comm)
        with forward_context(self.gatherer, self.activations), self.clock.phase("forward"):
            yield

    def forward_window(self) -> ContextManager[None]:
        """One forward window around a trainer's step function, for step functions that call
        submodules rather than the model (forwards inside it join it). ``engine(x)`` and
        ``model(x)`` open their own window and need none."""
        self._check_open(settle=False)
        return self._window.explicit()

    def _host_grads_widened(self, grads: torch.Tensor) -> None:
        """The host gradient shard became fp32 (a second backward before a step)."""
        self.grads = self.stepper.grads = grads

    # -- the model's face ----------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def training(self) -> bool:
        return self._module.training

    def train(self, mode: bool = True) -> "Engine":
        """``module.train(mode)``, as on the model."""
        self._module.train(mode)
        return self

    def eval(self) -> "Engine":
        """``module.eval()``, as on the model."""
        self._module.eval()
        return self

    # -- the training loop ------------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's fp32 master shard; pass it to lr schedulers."""
        self._check_open(settle=False)  # an update running on took its hyperparameters
        return self.stepper.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.stepper.loss_scale

    @property
    def is_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward on this rank's micro-batch (tensors inside any containers
        go to the device, floating ones in the compute dtype). While training, every rank
        first takes rank 0's buffers (``broadcast_buffers``). The same call as
        ``model(*args, **kwargs)``: the root module's hooks do this (``engine/forward.py``)."""
        self._check_open(settle=False)
        return self._module(*args, **kwargs)

    forward = __call__

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as a forward of the engine, for a forward that is not the
        model's own call (e.g. ``activations.tiled_causal_lm_loss(engine.module, ...)``)."""
        args = move_inputs(args, self.device, self.dtype)
        kwargs = move_inputs(kwargs, self.device, self.dtype)
        with self.forward_window():
            return fn(*args, **kwargs)

    def gathered(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Inside :meth:`run`: ``module``'s parameters gathered for the block (stage 3; a
        no-op otherwise), for code that reads them without calling the module."""
        return self.gatherer.hold(module) if self.gatherer else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, final: bool | None = None) -> None:
        """Backpropagate ``loss`` (scaled by 1/gradient_accumulation_steps, and by the loss
        scale with float16); gradients are averaged over ranks. ``final``: this backward ends
        the accumulation window (default: counted from gradient_accumulation_steps; trainers
        that count micro-steps themselves pass it, with gradient_accumulation_steps=1)."""
        self._check_open()
        if loss.numel() != 1:
            raise ValueError(f"backward needs a scalar loss, got shape {tuple(loss.shape)}")
        scale = self.loss_scale / self.config.gradient_accumulation_steps
        final = self.is_accumulation_boundary if final is None else final
        self.reducer.begin_backward(final=final)
        self.stepper.begin_backward(final)
        self.reducer.on_landed = self.stepper.landing()
        if self.gatherer:
            self.gatherer.begin_backward()
        if self.activations is not None:
            self.activations.begin_backward()
        if final:
            # Freed heap pages go back now, while the heap is at its fullest: the pages the
            # activations hold stay resident for the next forward to reuse, where returning
            # them after the step would have that forward fault each of them in again.
            return_freed_memory()
        try:
            with self.clock.phase("backward"):
                (loss * scale if scale != 1.0 else loss).backward()
                self.reducer.end_backward()
        except BaseException:
            self.stepper.drop_early()
            raise
        finally:
            if self.gatherer:
                self.gatherer.end_backward()

    def step(self) -> bool:
        """Count a micro-step; at the accumulation boundary reduce, clip and apply the update.
        Returns True when an update was applied (False between boundaries, on overflow, or
        when no parameter had a gradient since the last update: nothing is stepped then,
        like ``torch.optim.AdamW`` skips parameters whose ``.grad`` is None). A SIGINT or
        SIGTERM that arrives meanwhile is raised once the step has ended (docs/preemption.md)."""
        boundary = self.is_accumulation_boundary
        with signals_held():
            applied = self._step()
        if boundary and self.preemption is not None:
            self._stop_if_preempted()
        return applied

    @property
    def preempted(self) -> int:
        """The signal the ranks agreed to stop for at the last ``step()`` (0: none), with
        ``save_on_preemption``."""
        return 0 if self.preemption is None else self.preemption.agreed

    def _stop_if_preempted(self) -> None:
        """With ``save_on_preemption``: collective, after a step that ended a window."""
        assert self.preemption is not None
        signum = self.preemption.agree()
        folder = self.config.save_on_preemption
        if not signum or not isinstance(folder, str):
            return
        path = self.save_checkpoint(folder)
        log.warning("preempted: checkpoint saved at %s; exiting", path)
        self.close(hand_back=False)  # its files go now; the values are in the checkpoint
        raise SystemExit(exit_status(signum))

    def _step(self) -> bool:
        self._check_open()
        boundary = self.is_accumulation_boundary
        self.micro_steps += 1
        if not boundary:
            self.stepper.drop_early()  # a backward passed final=True off the boundary
            return False
        with self.clock.phase("step"):
            flags = self.reducer.reduce_accumulated()
            applied = self.stepper.step(
                flags, self.reducer.reduce_late, defer=weak_hook(self._end_deferred_update)
            )
            if self.stepper.pending is None:
                self._end_update()
        if applied:
            self.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.last_step = summarize(self, applied, self.stepper.updater.last_timings)
        self.clock.reset()
        self._last_comm = self.comm.stats()
        self.comm.reset_stats()
        self.unit_states.reset_counts()
        self.reducer.reset_counts()
        if self.gatherer:
            self._last_step_peak = self.gatherer.peak_gathered_bytes
            self.gatherer.reset_peak()
        if self.activations is not None:
            self.activations.reset_peak()
        if self.gatherer or not self._first_boundary_passed:
            # Stage 3: the pages of the units the backward released go back before the
            # reads ahead for the next step take fresh blocks, which would leave RSS
            # wandering with them. Any stage, once: the first step laid its blocks out while
            # glibc's mmap threshold was still rising (large blocks mapped apart), so the
            # next forward, whose blocks land in the heap, would not reuse its free pages.
            self._first_boundary_passed = True
            return_freed_memory()
        if self.gatherer:
            self.gatherer.prefetch_first()
        return applied

    def _end_update(self) -> None:
        """After the update: every parameter write stored, the gradients dropped."""
        if self.param_store is not None:
            self.param_store.flush()
        self.reducer.zero()

    def _end_deferred_update(self) -> None:
        """The end of an update that ran under the forward (``overlap_step``)."""
        self._end_update()
        self.last_step.update(optimizer_stats(self.stepper.updater.last_timings))
        return_freed_memory()  # what the update freed, before backward takes fresh blocks

    def finish_step(self) -> None:
        """Wait until the last step's update, running under the next forward with
        ``overlap_step``, has ended (every other engine method waits for it first too)."""
        self._check_open()

    def zero_grad(self) -> None:
        """Drop accumulated gradients (``step`` already does this after an update)."""
        self._check_open()
        self.stepper.drop_early()
        self.reducer.zero()

    # -- checkpoints (zero_offload.checkpoint; imported on use, it sits above the engine) ----
    def save_checkpoint(
        self, directory: str | os.PathLike, tag: str | None = None, lr_scheduler: Any = None
    ) -> "os.PathLike":
        """Save this rank's shards (and, rank 0, the manifest) under ``directory/tag``
        (default tag ``step<N>``); ``latest`` moves only once it is complete. Collective.
        Refused with gradients accumulated and not yet stepped (a checkpoint does not carry
        them): save at an accumulation boundary, after ``step()``."""
        self._check_open()
        # a broken state says so first: load_checkpoint fixes it
        self.stepper.updater.ensure_sound("save a checkpoint")
        if self.reducer.backwards:
            raise RuntimeError(
                f"save_checkpoint: {self.reducer.backwards} backward(s) accumulated gradients "
                "that no step() has applied yet, and a checkpoint does not carry gradients: "
                "save at an accumulation boundary, after the step() that applies them "
                "(engine.is_accumulation_boundary is True before the backward whose step() "
                "updates), or call engine.zero_grad() first to drop them"
            )
        from ..checkpoint import save_checkpoint

        return save_checkpoint(self, directory, tag, lr_scheduler or self.lr_scheduler)

    def load_checkpoint(
        self,
        directory: str | os.PathLike,
        tag: str | None = None,
        lr_scheduler: Any = None,
        convert_state: bool = False,
    ) -> str:
        """Resume from ``directory/tag`` (default: ``latest``), saved by any world size and
        stage; returns the tag. Collective. ``convert_state``: accept optimizer state saved
        with another kind or precision, converted through fp32 (else a CheckpointError)."""
        self._check_open()
        from ..checkpoint import load_checkpoint

        return load_checkpoint(
            self, directory, tag, lr_scheduler or self.lr_scheduler, convert_state
        )

    # -- inspection -------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision parameters (every name, tied ones too) and persistent buffers (what
        ``model.load_state_dict`` takes; rank 0's buffers), on the CPU, gathered from all
        ranks' shards: the fp32 masters, and for frozen parameters their compute-dtype values.
        Collective: every rank must call it. Device memory: one unit at a time."""
        self._check_open()
        return export.full_state_dict(self)

    def frozen_shard(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's shard of a frozen unit in fp32 on the CPU. Frozen parameters keep no
        fp32 master: their values are the compute-dtype parameters (exact in fp32; in
        bf16/fp16, what training used)."""
        return export.frozen_shard(self, unit)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds per tier and kind, counted from the tensors it holds."""
        self._check_open()
        return export.memory_report(self)


def initialize(
    model: nn.Module, config: Mapping[str, Any] | str | os.PathLike | None = None, **kwargs: Any
) -> Engine:
    """Wrap ``model`` for ZeRO training. Keywords (or the same keys in ``config``, a dict or a
    JSON file path) are listed by :func:`zero_offload.config.config_keys` and documented in
    ``docs/keywords.md``; a bad one raises :class:`zero_offload.ConfigError`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize needs a torch.nn.Module, got {type(model).__name__}")
    return Engine(model, build_config(config, **kwargs))
