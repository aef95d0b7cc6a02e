"""The training engine: ZeRO stages 0–3 around an ordinary ``torch.nn.Module``.

``initialize(model, **kwargs)`` validates the configuration, flattens the model's parameters
into units (``params.units``), and wires three parts together: the gradient reducer
(``grads.reducer``), the sharded optimizer (``update.stepper``) and, in stage 3, the parameter
gatherer (``params.gather``). The model's own parameters become views into the units' flat
buffers, so the user's module runs unchanged. The engine is composed of objects that share the
parts (``engine.build.Parts``), built by ``engine.parts.compose``: a ``ForwardDriver``
(``engine.forward``) the model's calls go through, a ``StepDriver`` (``engine.steps``) for
backward and step, a ``Lifecycle`` (``engine.lifecycle``) that checks it is open, lends
parameters their values and closes it, and a ``StateView`` (``engine.state``) that
checkpoints and exports read; its public names pass on to them.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping

import torch
import torch.nn as nn

from ..config import ZeroConfig, build_config
from ..interrupts import signals_held
from ..memory.ledger import MemoryReport
from ..optim.policy import StatePolicy
from ..params.store import ParamStore
from ..params.units import FlatUnit, persistent_buffers
from ..swap.swapper import Swapper
from ..update.api import StepTimings
from ..update.nvme.sizing import OptimizerSplit
from ..update.stepper import ShardStepper
from .build import Leftovers, check_parameters
from .parts import Runtime, compose
from .state import StateArrays

__all__ = ["Engine", "initialize", "persistent_buffers"]


class Engine:
    """Runs forward/backward/step of one data-parallel rank. Build it with :func:`initialize`."""

    def __init__(
        self, model: nn.Module, config: ZeroConfig, runtime: Runtime | None = None
    ) -> None:
        """``runtime``: the machine-facing parts (side streams, the host gradient worker, the
        device optimizer); None: the real ones. A rehearsal passes simulated ones."""
        self.config = config
        check_parameters(model)
        self._module = model
        self.dtype = config.precision.dtype
        self.stage = config.stage
        self.sharding = config.sharding  # what the stage shards, for the parts
        # What must be released however this engine ends (close(), collection, exit, or an
        # error below); it holds nothing that refers back to the engine.
        leftovers = Leftovers()
        finalizer = weakref.finalize(self, leftovers.release)
        try:
            built = compose(model, config, runtime or Runtime(), leftovers, finalizer)
        except BaseException:
            finalizer()  # a half-built engine is not usable
            raise
        self.comm, self.device, self.streams = built.comm, built.device, built.streams
        self.threads = built.threads  # threads per kind of CPU work (device.threads)
        self._parts, self.record, self._window = built.parts, built.record, built.window
        self._lifecycle, self._steps, self._state = built.lifecycle, built.steps, built.state
        self._forward, self.preemption = built.forward, built.preemption

    # -- the model's face and its calls (engine.forward.ForwardDriver) --------------------------
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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward on this rank's micro-batch (tensors inside any containers
        go to the device, floating ones in the compute dtype). While training, every rank
        first takes rank 0's buffers (``broadcast_buffers``). The same call as
        ``model(*args, **kwargs)``: the root module's hooks do this (``engine/forward.py``)."""
        return self._forward.call(*args, **kwargs)

    forward = __call__

    def forward_window(self) -> ContextManager[None]:
        """One forward window around a trainer's step function, for step functions that call
        submodules rather than the model (forwards inside it join it). ``engine(x)`` and
        ``model(x)`` open their own window and need none."""
        return self._forward.window()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as a forward of the engine, for a forward that is not the
        model's own call (e.g. ``activations.tiled_causal_lm_loss(engine.module, ...)``)."""
        return self._forward.run(fn, *args, **kwargs)

    def gathered(self, module: nn.Module) -> ContextManager[None]:
        """Inside :meth:`run`: ``module``'s parameters gathered for the block (stage 3; a
        no-op otherwise), for code that reads them without calling the module."""
        return self._forward.gathered(module)

    # -- the training loop (engine.steps.StepDriver) --------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's fp32 master shard; pass it to lr schedulers."""
        return self._state.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self._state.loss_scale

    @property
    def is_accumulation_boundary(self) -> bool:
        return self._steps.is_accumulation_boundary

    @property
    def lr_scheduler(self) -> Any:
        """The lr scheduler the engine steps after each applied update and saves with every
        checkpoint: a DeepSpeed config's schedule, or one of yours assigned here (None:
        none)."""
        return self._steps.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self._steps.lr_scheduler = scheduler

    def backward(self, loss: torch.Tensor, *, final: bool | None = None) -> None:
        """Backpropagate ``loss`` (scaled by 1/gradient_accumulation_steps, and by the loss
        scale with float16); gradients are averaged over ranks. ``final``: this backward ends
        the accumulation window (default: counted from gradient_accumulation_steps; trainers
        that count micro-steps themselves pass it, with gradient_accumulation_steps=1)."""
        self._steps.backward(loss, final)

    def step(self) -> bool:
        """Count a micro-step; at the accumulation boundary reduce, clip and apply the update.
        Returns True when an update was applied (False between boundaries, on overflow, or
        when no parameter had a gradient since the last update: nothing is stepped then,
        like ``torch.optim.AdamW`` skips parameters whose ``.grad`` is None). A SIGINT or
        SIGTERM that arrives meanwhile is raised once the step has ended (docs/preemption.md)."""
        boundary = self.is_accumulation_boundary
        with signals_held():
            applied = self._steps.step()
        if boundary and self.preemption is not None:
            # collective, after a step that ended a window
            self.preemption.stop_if_agreed(
                self.config.save_on_preemption, self.save_checkpoint, self.close
            )
        return applied

    @property
    def preempted(self) -> int:
        """The signal the ranks agreed to stop for at the last ``step()`` (0: none), with
        ``save_on_preemption``."""
        return 0 if self.preemption is None else self.preemption.agreed

    def finish_step(self) -> None:
        """Wait until the last step's update, running under the next forward with
        ``overlap_step``, has ended (every other engine method waits for it first too)."""
        self._lifecycle.check_open()

    def zero_grad(self) -> None:
        """Drop accumulated gradients (``step`` already does this after an update); in the
        middle of an accumulation window, the window starts again from its first micro-step."""
        self._steps.zero_grad()

    # -- checkpoints and exports (engine.state.StateView hands itself to them) ------------------
    def save_checkpoint(
        self, directory: str | os.PathLike, tag: str | None = None, lr_scheduler: Any = None
    ) -> "os.PathLike":
        """Save this rank's shards (and, rank 0, the manifest) under ``directory/tag``
        (default tag ``step<N>``); ``latest`` moves only once it is complete. Collective.
        Refused with gradients accumulated and not yet stepped (a checkpoint does not carry
        them): save at an accumulation boundary, after ``step()``."""
        return self._state.save_checkpoint(directory, tag, lr_scheduler or self.lr_scheduler)

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
        return self._state.load_checkpoint(
            directory, tag, lr_scheduler or self.lr_scheduler, convert_state
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision parameters (every name, tied ones too) and persistent buffers (what
        ``model.load_state_dict`` takes; rank 0's buffers), on the CPU, gathered from all
        ranks' shards: the fp32 masters, and for frozen parameters their compute-dtype values.
        Collective: every rank must call it. Device memory: one unit at a time."""
        return self._state.full_state_dict()

    def frozen_shard(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's shard of a frozen unit in fp32 on the CPU. Frozen parameters keep no
        fp32 master: their values are the compute-dtype parameters (exact in fp32; in
        bf16/fp16, what training used)."""
        return self._state.frozen_shard(unit)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds per tier and kind, counted from the tensors it holds."""
        return self._state.memory_report()

    # -- the lifecycle (engine.lifecycle.Lifecycle) ---------------------------------------------
    def gathered_parameters(
        self, params: Iterable[nn.Parameter] | None = None
    ) -> ContextManager[None]:
        """Inside the block the model's parameters (or only ``params``) hold their current
        values, to read outside a forward: print them, take ``model.state_dict()``, evaluate
        by calling the model. At stage 3 each one holds a copy of its gathered values —
        collective: every rank enters the block, with the same ``params``; host or device
        memory for the copies — so tensors taken from them stay valid after the block, and
        changes made to them are not kept (training goes on from the optimizer's state; do
        not step inside). At stages 0-2 they hold their values anyway."""
        return self._lifecycle.gathered_parameters(params)

    def close(self, hand_back: bool = True) -> None:
        """End the engine and give the model back: each parameter becomes a plain tensor of
        its own holding the trained values in the compute dtype — on the compute device at
        stages 0–2; at stage 3 gathered unit by unit into host memory, with the buffers
        moved there too. Then hooks are removed, the gradient worker thread stops, swap files
        and host buffers are freed. The model can be initialized again. Idempotent.

        At stage 3 (world size > 1) closing gathers, so it is collective: every rank must
        call it. Called while an exception propagates (a ``finally`` block, ``with``), it
        does not communicate — the other ranks may never get there — and stage 3's sharded
        parameters are left on the meta device instead (keep values with checkpoints).
        ``hand_back=False`` does the same on purpose: for a model too large for host memory,
        after its checkpoint is saved. An engine collected without ``close()`` is released
        the same way."""
        self._lifecycle.close(hand_back)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the parts' layout (engine.build.Parts) -------------------------------------------------
    @property
    def units(self) -> list[FlatUnit]:
        return self._parts.units

    @property
    def trainable_numel(self) -> int:
        return self._parts.trainable_numel

    @property
    def shard_numel(self) -> int:
        return self._parts.shard_numel

    @property
    def grads(self) -> torch.Tensor | None:
        """This rank's reduced gradient shard, the window's gradients so far (None: they
        are in files)."""
        if self._parts.grads is not None and not self._lifecycle.closed:
            self._parts.reducer.target.flush()  # regions no piece reached yet read as zeros
        return self._parts.grads

    @property
    def param_store(self) -> ParamStore | None:
        return self._parts.param_store

    # -- the training state (engine.state.StateView) --------------------------------------------
    @property
    def micro_steps(self) -> int:
        return self.record.micro_steps

    @property
    def global_steps(self) -> int:
        return self.record.global_steps

    @property
    def optimizer_steps(self) -> int:
        """Updates applied to the optimizer state (Adam's bias-correction step)."""
        return self._state.optimizer_steps

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self._state.optimizer_steps = value

    @property
    def state_policy(self) -> StatePolicy:
        """The optimizer's kind and state precisions."""
        return self._state.state_policy

    def state_chunks(self) -> Iterator[tuple[int, StateArrays]]:
        """(rank-flat offset, [master, exp_avg, exp_avg_sq]) fp32 CPU pieces in increasing
        offset order: the optimizer's state streamed from its tier, then each frozen unit's
        values with moments that are zero (None)."""
        return self._state.state_chunks()

    def training_state(self) -> dict[str, Any]:
        """Counters and optimizer hyperparameters a resume needs (plain data)."""
        return self._state.training_state()

    def load_training_state(self, state: Mapping[str, Any]) -> None:
        self._state.load_training_state(state)

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer-state tensors this rank holds in memory, by role (master, exp_avg,
        exp_avg_sq); empty with the state on NVMe."""
        return self._state.optimizer_tensors()

    def reductions_in_flight(self) -> list[torch.Tensor]:
        """The buffers of gradient reductions not yet waited for (flat input and output)."""
        return self._state.reductions_in_flight()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds right now, by kind (``engine.state.StateView``): a
        memory tracker (the rehearsal) names each storage it sees by these."""
        return self._state.held_tensors()

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (None without ``max_grad_norm``)."""
        return self._state.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far: on a float16 overflow, or on inf/NaN gradients with
        ``skip_nonfinite_steps``."""
        return self._state.skipped_steps

    @property
    def last_step_timings(self) -> StepTimings:
        """Seconds and bytes of the last optimizer update (I/O, compute, overlap)."""
        return self._state.last_step_timings

    @property
    def sharded_optimizer(self) -> ShardStepper:
        """Deprecated name of the engine's stepper (it warns); read ``last_step_timings``,
        ``last_grad_norm`` or ``optimizer_steps`` instead."""
        return self._state.sharded_optimizer

    @property
    def update_progress(self) -> tuple[int, int] | None:
        """While the last step's update runs under the forward (``overlap_step``): elements
        of this rank's shard whose new values are stored, and elements in all; None when no
        update is running."""
        return self._state.update_progress

    @property
    def optimizer_split(self) -> OptimizerSplit | None:
        """How the NVMe optimizer places its state (``offload_optimizer_fraction``): elements
        in host memory and in files, its sub-group size; None when it is not on NVMe."""
        return self._state.optimizer_split

    @property
    def swappers(self) -> list[Swapper]:
        """The swap managers this rank uses (NVMe tiers): optimizer state, then parameters."""
        return self._state.swappers

    @property
    def last_comm(self) -> dict:
        """Collective counters of the last step."""
        return dict(self.record.comm)

    @property
    def last_step_peak(self) -> int:
        """Stage 3: the peak gathered parameter bytes of the last step."""
        return self.record.peak

    @property
    def last_step(self) -> dict[str, float]:
        """What the last step did: flat, loggable numbers (``engine.steps``)."""
        return self.record.last


def initialize(
    model: nn.Module, config: Mapping[str, Any] | str | os.PathLike | None = None, **kwargs: Any
) -> Engine:
    """Wrap ``model`` for ZeRO training. Keywords (or the same keys in ``config``, a dict or a
    JSON file path) are listed by :func:`zero_offload.config.config_keys` and documented in
    ``docs/keywords.md``; a bad one raises :class:`zero_offload.ConfigError`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize needs a torch.nn.Module, got {type(model).__name__}")
    return Engine(model, build_config(config, **kwargs))
