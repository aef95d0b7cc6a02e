"""The training engine: ZeRO stages 0–3 around an ordinary ``torch.nn.Module``.

``initialize(model, **kwargs)`` validates the configuration, flattens the model's parameters
into units (``stages.units``), and wires three parts together: the gradient reducer
(``stages.grads``), the sharded optimizer (``stages.stepper``) and, in stage 3, the parameter
gatherer (``stages.gather``). The model's own parameters become views into the units' flat
buffers, so the user's module runs unchanged.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from .comm import Comm
from .config import ZeroConfig, build_config
from .ledger import MemoryReport
from .optimizer_state import attach_state_dict
from .stages.gather import ParamGatherer
from .stages.grads import GradReducer, GradTarget, ResidentGrads
from .stages.stepper import ShardStepper
from .stages.host_grads import HostGradQueue
from .stages.param_store import ParamStore
from .stages.streams import Streams
from .stages.units import (FlatUnit, GatherState, UnitPlan, make_unit, parameter_references,
                           persistent_buffers, plan_units, trainable_numel)
from .stages.update_api import StepTimings, Updater
from .stages.updaters import make_updater
from .swap.swapper import Swapper
from .step_stats import StepClock, summarize
from .weights import PretrainedWeights

__all__ = ["Engine", "initialize", "persistent_buffers"]

log = logging.getLogger(__name__)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move tensors in (nested) inputs to the device; floating tensors take the compute dtype."""
    if isinstance(value, torch.Tensor):
        target = dtype if value.is_floating_point() else value.dtype
        return value.to(device=device, dtype=target)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, dtype) for v in value)
    if isinstance(value, Mapping):
        return type(value)({k: _to_device(v, device, dtype) for k, v in value.items()})
    return value


def _move_to_device(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)``, except that parameters on the meta device stay there until their
    unit materializes them."""
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
        return
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and not p.is_meta:
                p.data = p.data.to(device)
        for name, b in module._buffers.items():
            if b is not None:
                if b.is_meta:
                    raise ValueError(
                        f"buffer {name!r} of {type(module).__name__} is on the meta device; "
                        "zero_offload materializes meta parameters (through "
                        "reset_parameters() or init_weights) but cannot know a buffer's "
                        "values: build the model with only its parameters on the meta device "
                        "(accelerate.init_empty_weights() does so by default), or create its "
                        "buffers on a real device")
                module._buffers[name] = b.to(device)


def _split_host_budget(config: ZeroConfig) -> tuple[int | None, int | None]:
    """``host_memory_limit`` is one budget for the swap pools: split evenly when both the
    parameters and the optimizer state are on NVMe."""
    limit = config.offload.host_memory_limit
    if limit is None or config.offload.param != "nvme" or config.offload.optimizer != "nvme":
        return limit, limit
    return limit // 2, limit - limit // 2


class Engine:
    """Runs forward/backward/step of one data-parallel rank. Build it with :func:`initialize`."""

    def __init__(self, model: nn.Module, config: ZeroConfig) -> None:
        self.config = config
        self.comm = Comm(config.process_group)
        self.device = config.device or _default_device()
        self.dtype = config.precision.dtype
        self.stage = config.stage
        self._module = model
        self.streams = Streams(self.device)
        _move_to_device(model, self.device)
        plans = plan_units(model, stage=self.stage, world_size=self.comm.world_size,
                           bucket_size=config.reduce_bucket_size)
        self._weights = self._open_weights(plans) if config.init_weights else None
        shard_numel = sum(p.shard_numel for p in plans)
        param_budget, optimizer_budget = _split_host_budget(config)
        self.param_store = (ParamStore(config, shard_numel,
                                       max((p.shard_numel for p in plans), default=0),
                                       self.dtype, self.device, self.comm.rank, param_budget,
                                       self.streams)
                            if self.stage == 3 else None)
        # optimizer state and gradients cover the trainable prefix of the rank-flat shard
        self.trainable_numel = trainable = trainable_numel(plans)
        updater = make_updater(
            trainable, config, self.device, self.dtype, self.comm.rank,
            self.param_store.resident if self.param_store else None, optimizer_budget)
        self.units = self._make_units(plans, updater)
        if self._weights is not None:
            self._weights[0].close()
            self._weights = None
        self.grad_queue: HostGradQueue | None = None
        if getattr(updater, "grads_on_disk", False):
            self.grads = None  # the optimizer keeps them in files beside its state
            host_target: GradTarget = updater  # type: ignore[assignment]
        elif config.offload.optimizer == "none":
            self.grads = torch.zeros(trainable, dtype=self.dtype, device=self.device)
        else:  # the optimizer steps on the host: reduced gradient shards go there, in fp32
            self.grads = torch.zeros(trainable, dtype=torch.float32,
                                     pin_memory=torch.cuda.is_available())
            host_target = ResidentGrads(self.grads)
        if config.offload.optimizer == "none":
            target: GradTarget = ResidentGrads(self.grads)
        else:  # copied and summed in the background while backward runs on
            self.grad_queue = HostGradQueue(
                host_target, self.streams,
                max((p.shard_numel for p in plans if not p.frozen), default=0), self.dtype)
            target = self.grad_queue
        self.shard_numel = shard_numel
        self.gatherer = (ParamGatherer(model, self.units, self.comm, self.param_store,
                                       prefetch_depth=config.prefetch_depth,
                                       prefetch_bytes=config.prefetch_bytes)
                         if self.param_store else None)
        self.reducer = GradReducer(
            self.units, self.comm, self.stage, target,
            on_reduced=self.gatherer.release if self.gatherer else None)
        self.stepper = ShardStepper(self.units, config, self.comm, self.grads,
                                                  self.device, self.dtype, updater,
                                                  self.param_store, self.streams)
        attach_state_dict(self)  # engine.optimizer.state_dict() holds the state of every tier
        self.micro_steps = 0
        self.global_steps = 0
        self._last_comm: dict = {}
        self._last_step_peak = 0  # stage 3: peak gathered param bytes of the last step
        self.clock = StepClock()
        self.last_step: dict[str, float] = {}  # what the last step did (step_stats.summarize)
        log.info("zero_offload: stage %d, %d units, rank %d/%d, %s on %s", self.stage,
                 len(self.units), self.comm.rank, self.comm.world_size, self.dtype, self.device)

    def _open_weights(self, plans: list[UnitPlan]) -> tuple[PretrainedWeights, dict[str, str]]:
        """Check the pretrained file against the model before any memory is allocated."""
        weights = PretrainedWeights(self.config.init_weights)
        canonical = {id(p): n for plan in plans for n, p in zip(plan.names, plan.params)}
        aliases: dict[str, list[str]] = {}
        for name, p in self._module.named_parameters(remove_duplicate=False):
            if canonical[id(p)] != name:
                aliases.setdefault(canonical[id(p)], []).append(name)
        expected = {n: tuple(p.shape) for plan in plans for n, p in zip(plan.names, plan.params)}
        return weights, weights.resolve(expected, aliases)

    def _make_units(self, plans: list[UnitPlan], updater: Updater) -> list[FlatUnit]:
        """Materialize units one at a time, streaming each rank's fp32 shard into the
        optimizer's tier and (stage 3) its compute-dtype shard into the parameter store, so
        that no more than one unit is ever whole in memory."""
        refs = parameter_references(self._module)
        units = []
        for plan in plans:
            values = None
            if self._weights is not None:
                weights, stored = self._weights
                values = [weights.load(stored[name]) for name in plan.names]
            unit, master = make_unit(
                plan, stage=self.stage, rank=self.comm.rank, dtype=self.dtype,
                device=self.device, persistence_threshold=self.config.param_persistence_threshold,
                comm=self.comm, refs=refs, values=values)
            if not unit.frozen:  # a frozen unit's values live in its compute-dtype params
                updater.load_state(unit.shard_offset, master if self.config.offload.optimizer
                                   == "none" else master.cpu())
            if self.param_store is not None:
                lo, hi = unit.layout.shard_range(self.comm.rank)
                self.param_store.put(unit, unit.full[lo:hi])  # copied: ``full`` can go now
                unit.free()
            units.append(unit)
        if self.param_store is not None:
            self.param_store.flush()
        return units

    # -- the training loop ------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's fp32 master shard; pass it to lr schedulers."""
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
        """Run the model's forward on this rank's micro-batch."""
        args = _to_device(args, self.device, self.dtype)
        kwargs = _to_device(kwargs, self.device, self.dtype)
        ctx = self.gatherer.forward() if self.gatherer else contextlib.nullcontext()
        with ctx, self.clock.phase("forward"):
            return self._module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, *, final: bool | None = None) -> None:
        """Backpropagate ``loss`` (scaled by 1/gradient_accumulation_steps, and by the loss
        scale with float16); gradients are averaged over ranks. ``final``: this backward ends
        the accumulation window (default: counted from gradient_accumulation_steps; trainers
        that count micro-steps themselves pass it, with gradient_accumulation_steps=1)."""
        if loss.numel() != 1:
            raise ValueError(f"backward needs a scalar loss, got shape {tuple(loss.shape)}")
        scale = self.loss_scale / self.config.gradient_accumulation_steps
        self.reducer.begin_backward(
            final=self.is_accumulation_boundary if final is None else final)
        if self.gatherer:
            self.gatherer.begin_backward()
        try:
            with self.clock.phase("backward"):
                (loss * scale if scale != 1.0 else loss).backward()
                self.reducer.end_backward()
        finally:
            if self.gatherer:
                self.gatherer.end_backward()

    def step(self) -> bool:
        """Count a micro-step; at the accumulation boundary reduce, clip and apply the update.
        Returns True when an update was applied (False between boundaries, on overflow, or
        when no parameter had a gradient since the last update: nothing is stepped then,
        like ``torch.optim.AdamW`` skips parameters whose ``.grad`` is None)."""
        boundary = self.is_accumulation_boundary
        self.micro_steps += 1
        if not boundary:
            return False
        with self.clock.phase("step"):
            flags = self.reducer.reduce_accumulated()
            applied = self.stepper.step(flags, self.reducer.reduce_late)
            if self.param_store is not None:
                self.param_store.flush()
            self.reducer.zero()
        if applied:
            self.global_steps += 1
        self.last_step = summarize(self, applied)
        self.clock.reset()
        self._last_comm = self.comm.stats()
        self.comm.reset_stats()
        if self.gatherer:
            self._last_step_peak = self.gatherer.peak_gathered_bytes
            self.gatherer.reset_peak()
            self.gatherer.prefetch_first()
        return applied

    def zero_grad(self) -> None:
        """Drop accumulated gradients (``step`` already does this after an update)."""
        self.reducer.zero()

    # -- checkpoints (zero_offload.checkpoint; imported on use, it sits above the engine) ----
    def save_checkpoint(self, directory: str | os.PathLike, tag: str | None = None,
                        lr_scheduler: Any = None) -> "os.PathLike":
        """Save this rank's shards (and, rank 0, the manifest) under ``directory/tag``
        (default tag ``step<N>``); ``latest`` moves only once it is complete. Collective.
        Refused with gradients accumulated and not yet stepped (a checkpoint does not carry
        them): save at an accumulation boundary, after ``step()``."""
        if self.reducer.backwards:
            raise RuntimeError(
                f"save_checkpoint: {self.reducer.backwards} backward(s) accumulated gradients "
                "that no step() has applied yet, and a checkpoint does not carry gradients: "
                "save at an accumulation boundary, after the step() that applies them "
                "(engine.is_accumulation_boundary is True before the backward whose step() "
                "updates), or call engine.zero_grad() first to drop them")
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, directory, tag, lr_scheduler)

    def load_checkpoint(self, directory: str | os.PathLike, tag: str | None = None,
                        lr_scheduler: Any = None) -> str:
        """Resume from ``directory/tag`` (default: ``latest``), saved by any world size and
        stage; returns the tag. Collective."""
        from .checkpoint import load_checkpoint
        return load_checkpoint(self, directory, tag, lr_scheduler)

    def close(self) -> None:
        """Release swap files and host buffers now (also done when the engine is collected
        or the process exits normally)."""
        try:
            if self.grad_queue is not None:
                self.grad_queue.close()
        finally:
            self.stepper.close()

    # -- what checkpoints read and restore (``zero_offload.checkpoint`` uses only these) -----
    def state_chunks(self) -> Iterator[tuple[int, list[torch.Tensor | None]]]:
        """(rank-flat offset, [master, exp_avg, exp_avg_sq]) fp32 CPU pieces in increasing
        offset order: the optimizer's state streamed from its tier, then each frozen unit's
        values with moments that are zero (None)."""
        for lo, _hi, *arrays in self.stepper.updater.iter_state():
            yield lo, list(arrays)
        for unit in sorted((u for u in self.units if u.frozen), key=lambda u: u.shard_offset):
            yield unit.shard_offset, [self.frozen_shard(unit), None, None]

    def load_unit_state(self, unit: FlatUnit, master: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor) -> None:
        """Restore one unit's shard: optimizer state (trainable units) and parameters."""
        if not unit.frozen:
            self.stepper.updater.load_state(unit.shard_offset, master, exp_avg, exp_avg_sq)
        self.stepper.write_params(unit, master)

    def finish_load(self) -> None:
        """After every :meth:`load_unit_state`: parameters are in place, gradients empty."""
        if self.param_store is not None:
            self.param_store.flush()
        self.zero_grad()

    def training_state(self) -> dict[str, Any]:
        """Counters and optimizer hyperparameters a resume needs (plain data)."""
        opt = self.stepper
        return {"micro_steps": self.micro_steps, "global_steps": self.global_steps,
                "optimizer_steps": self.optimizer_steps,
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.optimizer.param_groups],
                "loss_scaler": opt.scaler.state_dict() if opt.scaler else None,
                "missed_updates": opt.missed_updates()}

    def load_training_state(self, state: Mapping[str, Any]) -> None:
        self.micro_steps = state["micro_steps"]
        self.global_steps = state["global_steps"]
        self.optimizer_steps = state["optimizer_steps"]
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update(saved)
        self.stepper.load_missed_updates(state.get("missed_updates", {}))  # absent: older files
        scaler = self.stepper.scaler
        if scaler is not None and state["loss_scaler"] is not None:
            scaler.load_state_dict(state["loss_scaler"])

    @property
    def optimizer_steps(self) -> int:
        """Updates applied to the optimizer state (Adam's bias-correction step)."""
        return self.stepper.updater.steps

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self.stepper.updater.steps = value

    # -- read-only views for users, benchmarks and tests -------------------------------------
    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (None without ``max_grad_norm``)."""
        return self.stepper.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """float16 steps skipped on overflow so far."""
        scaler = self.stepper.scaler
        return scaler.skipped_steps if scaler else 0

    @property
    def last_step_timings(self) -> StepTimings:
        """Seconds and bytes of the last optimizer update (I/O, compute, overlap)."""
        return self.stepper.updater.last_timings

    @property
    def swappers(self) -> list[Swapper]:
        """The swap managers this rank uses (NVMe tiers): optimizer state, then parameters."""
        found = [getattr(self.stepper.updater, "swapper", None),
                 getattr(self.param_store, "swapper", None)]
        return [s for s in found if s is not None]

    # -- inspection -------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision parameters (every name, tied ones too) and persistent buffers (what
        ``model.load_state_dict`` takes), on the CPU, gathered from all ranks' shards: the fp32
        masters, and for frozen parameters their compute-dtype values. Collective: every rank
        must call it."""
        master = self.stepper.updater.master_values().to(self.device)
        values: dict[int, torch.Tensor] = {}
        for u in self.units:
            full = torch.empty(u.layout.padded_numel, dtype=torch.float32, device=self.device)
            shard = self.frozen_shard(u).to(self.device) if u.frozen else \
                master[u.shard_offset:u.shard_offset + u.shard_numel]
            if u.layout.num_shards == 1:
                full.copy_(shard)
            else:
                self.comm.all_gather(full, shard)
            for p, slot in zip(u.params, u.layout.slots):
                values[id(p)] = full[slot.offset:slot.end].view(slot.shape).cpu().clone()
        out: dict[str, torch.Tensor] = {}
        for name, p in self._module.named_parameters(remove_duplicate=False):
            out[name] = values[id(p)]
        for name, b in persistent_buffers(self._module).items():
            out[name] = b.detach().cpu().clone()
        return out

    def frozen_shard(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's shard of a frozen unit in fp32 on the CPU. Frozen parameters keep no
        fp32 master: their values are the compute-dtype parameters (exact in fp32; in
        bf16/fp16, what training used)."""
        lo, hi = unit.layout.shard_range(0 if unit.layout.num_shards == 1 else self.comm.rank)
        if not unit.sharded_params:
            return unit.full[lo:hi].float().cpu()
        assert self.param_store is not None
        shard, copied = self.param_store.load(unit)
        self.streams.wait(copied)
        return shard.float().cpu()

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds per tier and kind, counted from the tensors it holds."""
        rep = MemoryReport()
        for u in self.units:
            if not u.sharded_params:
                rep.add("device", "params", u.full_bytes)
                if self.stage == 3:
                    rep.persistent_param_bytes += u.full_bytes
            elif u.state is not GatherState.FREE:
                rep.add("device", "params", u.full_bytes)
            for p in u.params:
                if p.grad is not None:
                    rep.add("device", "grads", p.grad.numel() * p.grad.element_size())
        if self.grads is not None:
            grads_tier = "device" if self.config.offload.optimizer == "none" else "host"
            rep.add(grads_tier, "grads", self.grads.numel() * self.grads.element_size())
        self.stepper.add_to(rep)
        if self.grad_queue is not None:
            self.grad_queue.add_to(rep)
        if self.gatherer:
            rep.peak_gathered_param_bytes = max(self._last_step_peak,
                                                self.gatherer.peak_gathered_bytes)
        rep.comm = dict(self._last_comm)
        return rep


def initialize(model: nn.Module, config: Mapping[str, Any] | str | os.PathLike | None = None,
               **kwargs: Any) -> Engine:
    """Wrap ``model`` for ZeRO training. Keywords (or the same keys in ``config``, a dict or a
    JSON file path) are listed by :func:`zero_offload.config.config_keys` and documented in
    the README; a bad one raises :class:`zero_offload.ConfigError`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize needs a torch.nn.Module, got {type(model).__name__}")
    return Engine(model, build_config(config, **kwargs))
