"""How long a step will take, per phase, and what bounds it: the bytes and FLOPs a step of the
engine moves and computes (:class:`Workload`) divided by what the machine runs them at
(:class:`~.hardware.Rates`).

A phase takes as long as its busiest resource: the device's compute, the PCIe link, the
collectives, the node's disk (shared by its ranks) and its CPU optimizer. The optimizer
update goes where the engine runs it: under the backward that ends the window
(``step_during_backward``: as much as the disk has room for beside the backward's own
reads), under the next forward (``overlap_step``), and what is left in ``step()``. On a CPU
device the update's Adam takes the cores the model computes on, so it adds to the compute.
The workload comes from the memory estimate's layout (``workload``) or from a rehearsal's
counts of what the engine moved; docs/step_time.md holds the model to measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ...memory.sizes import dtype_bytes
from ...optim.policy import StatePolicy
from ..estimate.activations import DecoderShape
from ..estimate.memory import MemoryEstimate
from ..estimate.state import FP32_STATE
from .hardware import Rates

__all__ = [
    "PhaseWork",
    "UpdateWork",
    "Workload",
    "Phase",
    "StepPrediction",
    "workload",
    "predict",
    "attention_flops",
]

PHASES = ("forward", "backward", "step")
_UNITS = {"bytes": (1e9, "GB"), "FLOP": (1e12, "TFLOP"), "params": (1e9, "G params")}
# step(): the gradient shard read for the norm / overflow check (not zeroed after: the next
# window's first pieces overwrite it, grads.ResidentGrads)
_HOST_PASSES = 1


@dataclass(frozen=True)
class PhaseWork:
    """What one phase of one rank does: FLOPs, bytes each way over PCIe, bytes read and
    written on the swap disk, bytes of collectives, bytes of host-memory passes."""

    flops: float = 0.0
    h2d: float = 0.0
    d2h: float = 0.0
    disk_read: float = 0.0
    disk_write: float = 0.0
    comm: float = 0.0
    host: float = 0.0


@dataclass(frozen=True)
class UpdateWork:
    """The optimizer update of one rank: parameters the CPU optimizer steps, its disk bytes
    (state of the NVMe sub-groups, new parameters on NVMe), parameters stepped on the device,
    and the new compute-dtype bytes a pass during backward writes aside and the forward reads."""

    cpu_params: float = 0.0
    disk_read: float = 0.0
    disk_write: float = 0.0
    device_params: float = 0.0
    values: float = 0.0
    nvme_params: float = 0.0  # parameters whose state is in files


@dataclass(frozen=True)
class Workload:
    forward: PhaseWork
    backward: PhaseWork
    step: PhaseWork
    update: UpdateWork
    ranks_per_node: int = 1
    overlap_step: bool = False
    step_during_backward: bool = False
    tokens: int = 0  # per rank per step
    policy: StatePolicy = FP32_STATE  # the optimizer's kind and state precisions
    offload_optimizer: str = "none"
    nvme_fraction: float | None = None

    @property
    def state_bytes(self) -> float:
        """Optimizer state bytes per parameter."""
        return self.policy.bytes_per_param

    def phase(self, name: str) -> PhaseWork:
        return {"forward": self.forward, "backward": self.backward, "step": self.step}[name]


@dataclass(frozen=True)
class Phase:
    """A phase's predicted seconds and each resource's busy seconds in it."""

    name: str
    seconds: float
    parts: dict[str, float]

    @property
    def bound(self) -> str:
        return max(self.parts, key=lambda k: self.parts[k]) if self.parts else "-"


@dataclass(frozen=True)
class StepPrediction:
    phases: tuple[Phase, ...]
    totals: dict[str, tuple[float, float, str]]  # resource: (seconds, amount, unit)
    rates: Rates
    work: Workload
    advice: tuple[str, ...] = field(default=())

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def __getitem__(self, name: str) -> float:
        return next(p.seconds for p in self.phases if p.name == name)

    @property
    def bound(self) -> str:
        """The resource busy longest over the step."""
        return max(self.totals, key=lambda k: self.totals[k][0])

    def headline(self) -> str:
        """'disk-bound: 140 GB/step at 6.0 GB/s = 23.3 s; compute 4.1 s, ...'."""
        b = self.bound
        sec, amount, unit = self.totals[b]
        scale, name = _UNITS[unit]
        rate = f" at {amount / sec / scale:.3g} {name}/s" if sec > 0 else ""
        others = [f"{k} {v[0]:.1f} s" for k, v in self.totals.items() if k != b and v[0] > 0]
        return f"{b}-bound: {amount / scale:.1f} {name}/step{rate} = {sec:.1f} s" + (
            f"; {', '.join(others)}" if others else ""
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "bound": self.bound,
            "headline": self.headline(),
            "phases": {p.name: {"seconds": p.seconds, "parts": p.parts} for p in self.phases},
            "totals": {k: {"seconds": v[0], "amount": v[1]} for k, v in self.totals.items()},
            "rates": self.rates.to_dict(),
            "optimizer_state": self.work.policy.describe(),
            "advice": list(self.advice),
        }

    def __str__(self) -> str:
        lines = [
            f"predicted step: {self.seconds:.2f} s ({self.rates.source or 'given rates'})",
            f"  {'phase':<9} {'s':>8}  bound      busy s per resource",
        ]
        for p in self.phases:
            busy = ", ".join(f"{k} {v:.2f}" for k, v in p.parts.items() if v > 0)
            lines.append(f"  {p.name:<9} {p.seconds:>8.2f}  {p.bound:<9}  {busy or '-'}")
        lines.append(f"  {self.headline()}")
        lines += [f"  to move it: {a}" for a in self.advice]
        return "\n".join(lines)


def workload(
    e: MemoryEstimate,
    *,
    tokens: int,
    checkpointing: bool = False,
    overlap_step: bool = True,
    step_during_backward: bool = True,
    attention_flops: float = 0.0,
) -> Workload:
    """One rank's step of the configuration ``e`` describes, ``tokens`` tokens a micro-batch.

    FLOPs: 2 · params · tokens forward (+ ``attention_flops``), twice that backward, and one
    forward more with ``checkpointing``. Bytes: stage 3 gathers every unit in forward and
    again in backward (from host memory over PCIe, or read from NVMe); gradients of an
    offloaded optimizer go to the host; the update moves the state's bytes a parameter (``e``'s
    policy) each way for its sub-groups in files, and writes new parameters kept on NVMe."""
    n, b = e.num_gpus, dtype_bytes(e.dtype)
    s, s_t = e.shard_numel, e.trainable_shard_numel
    shards = (n - 1) / n if n > 1 else 0.0
    fwd_flops = 2.0 * e.num_params * tokens + attention_flops
    bwd_flops = 2 * fwd_flops + (fwd_flops if checkpointing else 0.0)
    gpu = e.device == "cuda"
    stage, opt, param = e.sharding, e.optimizer_tier, e.param_tier
    offloaded = opt.offloaded
    at_step = stage.sharded and not stage.reduces_during_backward  # stage 1 reduces at the step
    fwd, bwd, step = PhaseWork(flops=fwd_flops), PhaseWork(flops=bwd_flops), PhaseWork()
    # the parameters: stage 3 gathers them twice a step, the others all-gather after the step
    gathers = b * e.num_params * shards
    if stage.shards_params:
        fwd, bwd = replace(fwd, comm=gathers), replace(bwd, comm=gathers)
        shard = b * s
        if param.on_host and gpu:
            fwd, bwd = replace(fwd, h2d=shard), replace(bwd, h2d=shard)
        if param.on_nvme:
            fwd, bwd = replace(fwd, disk_read=shard), replace(bwd, disk_read=shard)
            if gpu:
                fwd, bwd = replace(fwd, h2d=shard), replace(bwd, h2d=shard)
    elif stage.sharded:
        step = replace(step, comm=gathers)
    # the gradients: reduced in backward (stage 0: all-reduce, twice the bytes)
    grads = b * e.trainable_params * shards * (2 if stage.all_reduces else 1)
    bwd = replace(bwd, comm=bwd.comm + (0.0 if at_step else grads))
    step = replace(step, comm=step.comm + (grads if at_step else 0.0))
    update = UpdateWork(device_params=0 if offloaded else s_t)
    if offloaded:
        if gpu:
            bwd = replace(bwd, d2h=bwd.d2h + b * s_t)
            if not stage.shards_params or not param.offloaded:
                step = replace(step, h2d=step.h2d + b * s)
        step = replace(step, host=_HOST_PASSES * b * s_t)
        nvme = round(e.nvme_fraction * s_t) if e.nvme_fraction is not None else 0
        # fp32 gradients in files (a host budget too small for them): written in backward,
        # read by the update (``OptimizerSplit.disk_bytes_per_step`` counts them)
        state_bytes = e.policy.bytes_per_param
        grad_files = 4 * s_t if e.disk_bytes_per_step - 2 * state_bytes * nvme > 4 * s_t else 0
        bwd = replace(bwd, disk_write=bwd.disk_write + grad_files)
        params_out = b * s if stage.shards_params and param.on_nvme else 0.0
        update = UpdateWork(
            cpu_params=s_t,
            disk_read=state_bytes * nvme + grad_files,
            disk_write=state_bytes * nvme + params_out,
            values=b * nvme,
            nvme_params=nvme,
        )
    sdb = step_during_backward and opt.on_nvme and stage.reduces_during_backward
    return Workload(
        fwd,
        bwd,
        step,
        update,
        ranks_per_node=e.ranks_per_node,
        overlap_step=overlap_step and stage.shards_params and opt.on_nvme,
        step_during_backward=sdb,
        tokens=tokens,
        policy=e.policy,
        offload_optimizer=e.offload_optimizer,
        nvme_fraction=e.nvme_fraction,
    )


def attention_flops(shape: DecoderShape, batch: int, seq: int) -> float:
    """Forward FLOPs of a decoder's attention scores and their weighted sum (the s² part
    that 2 · params · tokens leaves out), as a dense kernel computes them."""
    return 4.0 * batch * seq * seq * shape.heads * shape.head_dim * shape.layers


def _parts(w: PhaseWork, r: Rates, node: int) -> dict[str, float]:
    """Busy seconds per resource of one phase's own work (no update)."""
    compute = w.flops / r.step_flops
    host = w.host / r.host_memory
    parts = {"compute": compute + (host if r.cpu_device else 0.0)}
    if not r.cpu_device:
        parts["host memory"] = host
    if r.pcie:
        parts["PCIe"] = max(w.h2d, w.d2h) / r.pcie
    if r.interconnect and w.comm:
        parts["collectives"] = w.comm / r.interconnect
    parts["disk"] = _disk(w.disk_read, w.disk_write, r, node)
    return parts


def _disk(read: float, write: float, r: Rates, node: int) -> float:
    """Seconds of the node's disk for one rank's bytes (all ranks move as much): reads and
    writes take turns on the device (what ``bench step`` measured against raw O_DIRECT)."""
    if not (read or write):
        return 0.0
    if not (r.disk_read and r.disk_write):
        raise ValueError("this configuration uses NVMe: give the disk's read and write rates")
    return node * (read / r.disk_read + write / r.disk_write)


def predict(work: Workload, rates: Rates) -> StepPrediction:
    """Seconds per phase: each phase as long as its busiest resource, with the optimizer
    update placed where the engine runs it."""
    node = work.ranks_per_node
    u = work.update
    parts = {name: _parts(work.phase(name), rates, node) for name in PHASES}
    adam = node * u.cpu_params / rates.adam_for(work.policy)
    if u.device_params:  # torch's fused AdamW on the device: memory-bound, 28 B a param
        mem = rates.device_memory or rates.host_memory
        parts["step"]["compute"] += 28 * u.device_params / mem
    io = _disk(u.disk_read, u.disk_write, rates, node)
    left = 1.0  # share of the update not yet placed
    if work.step_during_backward and (io or adam):
        # the pass runs while the backward does: the disk's idle time bounds it, and on a
        # GPU node the host's cores too (on a CPU device its Adam takes the model's cores)
        length = max(parts["backward"].values())
        done = min(1.0, (length - parts["backward"]["disk"]) / io) if io else 1.0
        if adam and not rates.cpu_device:
            done = min(done, length / adam)
        _add_update(parts["backward"], rates, done * io, done * adam)
        # the forward reads the new values the pass wrote aside
        parts["forward"]["disk"] += _disk(done * u.values, 0.0, rates, node)
        left -= done
    if work.overlap_step and left > 0:
        _add_update(parts["forward"], rates, left * io, left * adam)
        left = 0.0
    if left > 0:
        parts["step"]["disk"] += left * io
        # the pipeline overlaps Adam with the disk; the step's pass over the gradients
        # (their norm) runs before it on the same cores
        passes = work.step.host / rates.host_memory
        parts["step"]["CPU optimizer"] = left * adam + passes
    phases = tuple(Phase(n, max(parts[n].values()), parts[n]) for n in PHASES)
    return StepPrediction(phases, _totals(work, rates, parts, adam), rates, work)


def _add_update(parts: dict[str, float], rates: Rates, io: float, adam: float) -> None:
    """Part of the update runs in this phase: its disk seconds beside the phase's, its Adam
    on the host's cores (the device's own cores on a CPU device)."""
    parts["disk"] += io
    if rates.cpu_device:
        parts["compute"] += adam
    else:
        parts["CPU optimizer"] = parts.get("CPU optimizer", 0.0) + adam


def _totals(
    work: Workload, r: Rates, parts: dict[str, dict[str, float]], adam: float
) -> dict[str, tuple[float, float, str]]:
    """Each resource's busy seconds over the step and the amount it moved (bytes, FLOPs)."""
    ws = [work.forward, work.backward, work.step]
    node = work.ranks_per_node
    disk_bytes = node * (
        sum(w.disk_read + w.disk_write for w in ws) + work.update.disk_read + work.update.disk_write
    )
    flops = sum(w.flops for w in ws)
    out: dict[str, tuple[float, float, str]] = {
        "compute": (flops / r.step_flops, flops, "FLOP"),
        "disk": (sum(p["disk"] for p in parts.values()), disk_bytes, "bytes"),
        "CPU optimizer": (adam, node * work.update.cpu_params, "params"),
    }
    if r.pcie:
        pcie = sum(max(w.h2d, w.d2h) for w in ws)
        out["PCIe"] = (pcie / r.pcie, pcie, "bytes")
    if r.interconnect:
        comm = sum(w.comm for w in ws)
        out["collectives"] = (comm / r.interconnect, comm, "bytes")
    return {k: v for k, v in out.items() if v[0] > 0 or k == "compute"}
