"""What a rehearsal found: device bytes per phase and kind, the planner's figures beside them,
a verdict against the GPU size, and what to change when it does not fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..memory.sizes import describe_params
from ..planning.estimate.activations import ActivationEstimate
from ..planning.estimate.memory import (
    FORWARD_BACKWARD,
    INITIALIZE,
    LOSS,
    REDUCE,
    RESIDENT,
    STEP,
    MemoryEstimate,
    ModelShape,
)
from ..policies import Tier
from .tracker import KINDS, PhaseMemory

__all__ = ["Rehearsal", "PHASES", "HONESTY", "tiers_note"]

PHASES = ("initialize", "forward", "backward", "step")
HONESTY = (
    "Device bytes are counted per allocation (torch.cuda.max_memory_allocated), "
    "without the CUDA context (~0.5-1 GB) and the caching allocator's slack: the "
    "headroom is for those. Values are not simulated: norms read 0, so no overflow or "
    "clipping is seen."
)


def tiers_note(nvme: bool) -> dict[str, str]:
    """What each tier was in a rehearsal: every one is simulated, none real; the engine's
    code that drives them is its own."""
    return {
        "GPU": "simulated: torch's meta device under FakeTensorMode, every allocation counted",
        "other ranks": "simulated: torch's fake process group (collectives return at once)",
        "host": "simulated: fake CPU tensors, sizes tracked, no data",
        "NVMe": (
            "simulated: the engine's swap code on a disk that tracks file sizes, no "
            "data and no file written (the swap folder is a real, empty temporary one)"
            if nvme
            else "not used"
        ),
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}" if abs(n) >= 1e8 or n == 0 else f"{n / 1e9:.4f}"


@dataclass
class Rehearsal:
    """The outcome of :func:`~zero_offload.rehearsal.rehearse`. ``phases``: measured
    :class:`~.tracker.PhaseMemory` per phase; ``activation_bytes``: the activations measured
    at the forward/backward peak (pass it to ``zo.plan(..., activation_bytes=...)``);
    ``estimate``: ``estimate_memory`` for the same configuration with those activations."""

    model: str
    num_params: int
    world_size: int
    gpu_memory: int
    headroom: float
    host_memory: int | None
    engine_kwargs: dict[str, Any]
    micro_batch: tuple[int, int] | None
    checkpointing: bool
    phases: dict[str, PhaseMemory]
    activation_bytes: int
    estimate: MemoryEstimate
    shape: ModelShape = field(repr=False)
    estimate_kwargs: dict[str, Any] = field(repr=False)
    problems: tuple[str, ...] = ()
    failure: str | None = None
    wall_s: float = 0.0
    max_rss_bytes: int = 0
    nvme_simulated: bool = False
    attention: str = ""  # which attention kernel was counted (``attention.describe_kernels``)
    attention_calls: dict[str, int] = field(default_factory=dict)
    # the planner's own activation figures for this run (a model family it knows), and
    # estimate_memory with them: what `zero-offload plan` says before any rehearsal
    planned_activations: ActivationEstimate | None = None
    planned_estimate: MemoryEstimate | None = None
    planner: str = ""  # the planner's explanation, when it chose the configuration

    # -- figures ----------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        """The largest device peak of any phase: what max_memory_allocated would report."""
        return max((m.device_peak for m in self.phases.values()), default=0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p].device_peak)

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory * (1 - self.headroom)

    @property
    def fits(self) -> bool:
        return self.failure is None and not self.problems and self.peak_bytes <= self.usable_bytes

    @property
    def device_clean(self) -> bool:
        return not self.problems

    def estimated_phase_bytes(self, estimate: MemoryEstimate | None = None) -> dict[str, int]:
        """The estimate's device bytes in each measured phase: initialize, the model's
        forward/backward (the loss's moment included), and ``engine.step()`` (stage 0-1
        reductions, then the update). ``estimate``: default the one with the measured
        activations."""
        e = estimate or self.estimate
        by = {
            p: sum(t.bytes for t in e.terms if t.tier == Tier.DEVICE and t.phase == p)
            for p in (RESIDENT, FORWARD_BACKWARD, LOSS, REDUCE, STEP, INITIALIZE)
        }
        return {
            "initialize": by[RESIDENT] + by[INITIALIZE],
            "forward/backward": by[RESIDENT] + max(by[FORWARD_BACKWARD], by[LOSS]),
            "step": by[RESIDENT] + max(by[REDUCE], by[STEP]),
        }

    @property
    def activations_peak(self) -> int:
        """The most activations at any of the forward's or backward's successive peaks."""
        return max(
            (self.phases[p].activations_peak for p in ("forward", "backward") if p in self.phases),
            default=0,
        )

    @property
    def planned_error(self) -> float | None:
        """(planned - measured) / measured of the forward/backward peak: the planner's own
        activation figures against the run; None when it has none for this model."""
        if self.planned_estimate is None:
            return None
        planned = self.estimated_phase_bytes(self.planned_estimate)["forward/backward"]
        measured = self.measured_phase_bytes()["forward/backward"]
        return (planned - measured) / max(measured, 1)

    def measured_phase_bytes(self) -> dict[str, int]:
        def peak(*phases: str) -> int:
            return max((self.phases[p].device_peak for p in phases if p in self.phases), default=0)

        return {
            "initialize": peak("initialize"),
            "forward/backward": peak("forward", "backward"),
            "step": peak("step"),
        }

    @property
    def estimate_error(self) -> float:
        """(estimate - measured) / measured of the peak."""
        return (self.estimate.gpu_bytes - self.peak_bytes) / max(self.peak_bytes, 1)

    # -- advice -----------------------------------------------------------------------------
    def suggestions(self) -> list[str]:
        """What would fit, when it does not."""
        if self.fits or self.failure is not None:
            return []
        over = self.peak_bytes - self.usable_bytes
        out = []
        acts = self.activation_bytes
        if self.micro_batch and acts > over and self.micro_batch[0] > 1:
            b, s = self.micro_batch
            per = acts / b
            fit = int(b - -(-over // per))
            if fit >= 1:
                out.append(
                    f"a micro-batch of {fit} × {s} tokens (activations scale with it; "
                    f"raise gradient_accumulation_steps to keep the global batch)"
                )
        if acts and not self.checkpointing:
            out.append(
                "activation checkpointing (checkpointing=True / --checkpointing) keeps "
                "only each layer's input through the forward"
            )
        host = self.host_memory if self.host_memory is not None else 2**62
        from ..planning.search.planner import plan

        advice = plan(
            self.shape,
            num_gpus=self.world_size,
            gpu_memory=self.gpu_memory,
            host_memory=host,
            activation_bytes=acts or None,
            headroom=self.headroom,
            dtype=self.estimate_kwargs["dtype"],
            prefetch_depth=self.estimate_kwargs["prefetch_depth"],
        )
        current = (
            self.estimate.stage,
            self.estimate.offload_optimizer,
            self.estimate.offload_param,
        )
        if (
            advice.choice is not None
            and (advice.choice.stage, advice.choice.offload_optimizer, advice.choice.offload_param)
            != current
        ):
            args = ", ".join(f"{k}={v!r}" for k, v in advice.kwargs.items())
            out.append(f"the planner, given the measured activations, recommends {args}")
        elif advice.choice is None:
            out.append(
                "the planner finds no stage × offload that fits with the measured "
                "activations: " + advice.explanation.splitlines()[-1]
            )
        return out

    def verdict(self) -> str:
        peak, usable = self.peak_bytes, self.usable_bytes
        if self.problems:
            return "NOT DEVICE-CLEAN: " + "; ".join(self.problems[:5])
        if self.failure is not None:
            return f"FAILED in {self.failure}"
        if peak <= usable:
            return (
                f"FITS: peak {_gb(peak)} GB ({self.peak_phase}) of {_gb(self.gpu_memory)} "
                f"GB per GPU, {_gb(usable - peak)} GB below the {self.headroom:.0%} "
                "headroom"
            )
        return (
            f"DOES NOT FIT: peak {_gb(peak)} GB ({self.peak_phase}) exceeds the "
            f"{_gb(usable)} GB usable of {_gb(self.gpu_memory)} GB per GPU by "
            f"{_gb(peak - usable)} GB"
        )

    # -- output -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "num_params": self.num_params,
            "world_size": self.world_size,
            "gpu_memory": self.gpu_memory,
            "headroom": self.headroom,
            "engine_kwargs": {
                k: str(v) if isinstance(v, torch.dtype) else v
                for k, v in self.engine_kwargs.items()
            },
            "micro_batch": list(self.micro_batch) if self.micro_batch else None,
            "checkpointing": self.checkpointing,
            "attention": self.attention,
            "attention_calls": dict(self.attention_calls),
            "optimizer_state": self.state_precision,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "verdict": self.verdict(),
            "problems": list(self.problems),
            "failure": self.failure,
            "activation_bytes": self.activation_bytes,
            "estimate_gpu_bytes": self.estimate.gpu_bytes,
            "estimate_error": self.estimate_error,
            "planned_activations": (
                None if self.planned_activations is None else vars(self.planned_activations)
            ),
            "planned_error": self.planned_error,
            "activations_peak": self.activations_peak,
            "suggestions": self.suggestions(),
            "planner": self.planner,
            "phases": {p: vars(m) for p, m in self.phases.items()},
            "wall_s": self.wall_s,
            "max_rss_bytes": self.max_rss_bytes,
            "tiers": tiers_note(self.nvme_simulated),
            "simulated": HONESTY,
        }

    @property
    def state_precision(self) -> str:
        """The optimizer-state policy rehearsed (and estimated), with its bytes per param."""
        return self.estimate.policy.describe()

    def _planned_lines(self) -> list[str]:
        pa, pe = self.planned_activations, self.planned_estimate
        if pa is None or pe is None:
            return []
        planned = self.estimated_phase_bytes(pe)["forward/backward"]
        measured = self.measured_phase_bytes()["forward/backward"]
        out = [
            "",
            f"planner's own activation estimate ({pa.describe()}): "
            f"{_gb(pa.running)} GB running, {_gb(pa.loss)} GB at the loss"
            + (f", {_gb(pa.host)} GB offloaded to the host" if pa.host else ""),
            f"  forward/backward  estimated {_gb(planned):>7} GB, measured "
            f"{_gb(measured):>7} GB ({self.planned_error:+.1%})",
            f"  activations       estimated {_gb(pa.device_bytes):>7} GB, measured "
            f"{_gb(self.activations_peak):>7} GB "
            f"({(pa.device_bytes - self.activations_peak) / max(self.activations_peak, 1):+.1%})",
        ]
        return out

    def __str__(self) -> str:
        kw = ", ".join(f"{k}={v!r}" for k, v in self.engine_kwargs.items())
        mb = (
            f", micro-batch {self.micro_batch[0]} × {self.micro_batch[1]} tokens"
            if self.micro_batch
            else ""
        )
        lines = [
            f"rehearsal: {self.model} ({describe_params(self.num_params, self.num_params)})"
            f", rank 0 of {self.world_size}, {_gb(self.gpu_memory)} GB GPUs{mb}"
            f"{', activation checkpointing' if self.checkpointing else ''}",
            f"  initialize({kw})",
            f"  attention: {self.attention or 'not recorded'}",
            f"  optimizer state: {self.state_precision}",
            "",
            "GPU GB per phase (peak, and what it held then):",
            f"  {'phase':<10} {'peak':>7}  "
            + "  ".join(f"{k[:11]:>11}" for k in KINDS)
            + f"  {'host peak':>9} {'H2D':>7} {'D2H':>7}"
            + (f" {'NVMe peak':>9} {'read':>7} {'written':>7}" if self.nvme_simulated else ""),
        ]
        for p in PHASES:
            m = self.phases.get(p)
            if m is None:
                continue
            lines.append(
                f"  {p:<10} {_gb(m.device_peak):>7}  "
                + "  ".join(f"{_gb(m.device_kinds.get(k, 0)):>11}" for k in KINDS)
                + f"  {_gb(m.host_peak):>9} {_gb(m.h2d_bytes):>7} "
                f"{_gb(m.d2h_bytes):>7}"
                + (
                    f" {_gb(m.nvme_peak):>9} {_gb(m.nvme_read):>7} {_gb(m.nvme_written):>7}"
                    if self.nvme_simulated
                    else ""
                )
            )
        est, meas = self.estimated_phase_bytes(), self.measured_phase_bytes()
        lines += [
            "",
            f"planner (estimate_memory, activations as measured: {_gb(self.activation_bytes)} GB):",
        ]
        for p in ("initialize", "forward/backward", "step"):
            diff = (est[p] - meas[p]) / max(meas[p], 1)
            lines.append(
                f"  {p:<17} estimated {_gb(est[p]):>7} GB, measured "
                f"{_gb(meas[p]):>7} GB ({diff:+.1%})"
            )
        for t in sorted(
            (t for t in self.estimate.terms if t.tier == Tier.DEVICE), key=lambda t: -t.bytes
        ):
            lines.append(f"    {_gb(t.bytes):>7} GB  {t.name} [{t.phase}] ({t.formula})")
        # the planner's own figures include activation offload's host buffers
        tiers = [
            ("host", (self.planned_estimate or self.estimate).host_bytes_per_rank, "host_peak")
        ]
        if self.nvme_simulated:
            tiers.append(("NVMe", self.estimate.nvme_bytes_per_rank, "nvme_peak"))
        for tier, estimated, attr in tiers:
            got = max((getattr(m, attr) for m in self.phases.values()), default=0)
            # what the step leaves is what the estimate counts as held (the peak adds
            # whatever the phases allocate for a moment)
            after = self.phases["step"].host_end if "step" in self.phases else None
            held = f", {_gb(after)} GB after the step" if attr == "host_peak" and after else ""
            lines.append(
                f"  {tier + ' (per rank)':<17} estimated {_gb(estimated):>7} GB, "
                f"measured {_gb(got):>7} GB{held}"
            )
        lines += self._planned_lines()
        lines += ["", f"device-clean: {'yes' if self.device_clean else 'NO'}"]
        lines += [f"  {p}" for p in self.problems]
        lines += [f"verdict: {self.verdict()}"]
        lines += [f"  try: {s}" for s in self.suggestions()]
        if self.planner:
            lines += [f"planner: {self.planner}"]
        lines += [
            "",
            f"rehearsed in {self.wall_s:.0f} s, max RSS {self.max_rss_bytes / 2**30:.2f} GiB",
            "tiers (none real):",
        ]
        lines += [f"  {k:<12} {v}" for k, v in tiers_note(self.nvme_simulated).items()]
        lines += [f"note: {HONESTY}"]
        return "\n".join(lines)
