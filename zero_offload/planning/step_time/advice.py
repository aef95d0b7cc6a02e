"""What would move a predicted step: each suggestion is the same workload changed the way
the suggestion says, predicted again (``step_time.predict.predict``), so its figure is the model's,
not a rule of thumb."""

from __future__ import annotations

from dataclasses import replace

from ...optim.policy import MasterPrecision, MomentPrecision, OptimizerKind, StatePolicy
from ..estimate.state import per_param_text
from .hardware import Rates
from .predict import PhaseWork, StepPrediction, Workload, predict

__all__ = ["predict_step", "advice", "with_policy", "low_precision"]


def low_precision(policy: StatePolicy) -> StatePolicy | None:
    """The smallest state the library offers for ``policy``'s kind: 8-bit moments and a bf16
    master with stochastic rounding (``docs/optimizer_states.md``); None for Adagrad, whose
    accumulator keeps fp32."""
    if policy.kind is OptimizerKind.ADAGRAD:
        return None
    return replace(policy, moments=MomentPrecision.INT8, master=MasterPrecision.BF16_SR)


_MORE_HOST = 100e9  # the host memory suggestion: this much more per node


def predict_step(work: Workload, rates: Rates) -> StepPrediction:
    """:func:`~.predict.predict` with what would move the step."""
    pred = predict(work, rates)
    return replace(pred, advice=tuple(advice(pred)))


def advice(pred: StepPrediction) -> list[str]:
    """Suggestions for a step bound by anything but the device's compute, each with the
    predicted step it would give."""
    w, r, out = pred.work, pred.rates, []
    u, node = w.update, w.ranks_per_node
    if u.nvme_params:
        # host memory for offload_optimizer_fraction: its state leaves the disk
        moved = min(u.nvme_params, _MORE_HOST / node / w.state_bytes)
        t = _with_nvme_params(w, u.nvme_params - moved)
        out.append(
            f"{_MORE_HOST / 1e9:.0f} GB more host memory per node for the optimizer "
            f"(offload_optimizer_fraction {_fraction(w, u.nvme_params - moved)}): "
            f"{_seconds(t, r, pred)}"
        )
        low = low_precision(w.policy)
        if low is not None and low.bytes_per_param < w.state_bytes:
            t = with_policy(w, low)
            out.append(
                f"low-precision optimizer states (8-bit moments + bf16 master, "
                f"{per_param_text(low.bytes_per_param)} instead of "
                f"{per_param_text(w.state_bytes)} bytes/param, the same host memory for them: "
                f"{_fraction(t, t.update.nvme_params)} on NVMe"
                f"{_rate_note(r, low)}): {_seconds(t, r, pred)}"
            )
    if pred.bound != "compute" and w.tokens:
        doubled = replace(w, forward=_twice(w.forward), backward=_twice(w.backward))
        per = predict(doubled, r)
        out.append(
            f"a micro-batch of twice the tokens: {per.seconds:.1f} s for {2 * w.tokens} tokens "
            f"({per.seconds / (2 * w.tokens) * 1e3:.2f} ms/token instead of "
            f"{pred.seconds / w.tokens * 1e3:.2f})"
        )
    if pred.bound == "compute":
        out.append(
            "the model's FLOPs: a faster or another GPU; with activation checkpointing, "
            "turning it off (or a smaller micro-batch that fits without it) saves a forward"
        )
    return out


def _seconds(work: Workload, rates: Rates, was: StepPrediction) -> str:
    p = predict(work, rates)
    return f"step {p.seconds:.1f} s instead of {was.seconds:.1f} ({p.bound}-bound)"


def _fraction(w: Workload, nvme: float) -> str:
    total = w.update.cpu_params
    return f"{nvme / total:.2f}" if total else "-"


def _twice(p: PhaseWork) -> PhaseWork:
    return replace(p, flops=2 * p.flops)


def _with_nvme_params(w: Workload, nvme: float) -> Workload:
    """The update with ``nvme`` parameters' state in files instead of its own count."""
    u, d = w.update, w.state_bytes * (nvme - w.update.nvme_params)
    values = u.values * nvme / u.nvme_params if u.nvme_params else 0.0
    return replace(
        w,
        update=replace(
            u,
            disk_read=u.disk_read + d,
            disk_write=u.disk_write + d,
            nvme_params=nvme,
            values=values,
        ),
    )


def with_policy(w: Workload, policy: StatePolicy) -> Workload:
    """The update with ``policy``'s state, its host memory for the optimizer state unchanged:
    smaller states keep more sub-groups in host memory, and move fewer bytes for those left
    in files."""
    u, state_bytes = w.update, policy.bytes_per_param
    host_bytes = w.state_bytes * (u.cpu_params - u.nvme_params)
    nvme = max(0.0, u.cpu_params - host_bytes / state_bytes)
    moved = _with_nvme_params(w, nvme)
    d = (state_bytes - w.state_bytes) * nvme
    v = moved.update
    return replace(
        moved,
        policy=policy,
        update=replace(v, disk_read=v.disk_read + d, disk_write=v.disk_write + d),
    )


def _rate_note(r: Rates, policy: StatePolicy) -> str:
    """Whether the suggestion's CPU optimizer rate was measured for its state."""
    if r.measured_rate(policy) is not None:
        return ""
    return "; its CPU optimizer taken at the fp32 kernel's rate"
