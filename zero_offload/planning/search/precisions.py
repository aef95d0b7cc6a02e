"""The plan's rows per optimizer-state precision, and which one it recommends.

Lower precision frees host memory and disk time (the 13B reference run's fp32 state is 156 GB
and needs NVMe; 8-bit moments with a bf16_sr master are 52 GB and fit in host memory), but it
changes what training computes (docs/optimizer_states.md). So the plan recommends fp32 state
unless the user allows lower precision; then it takes the highest precision whose
least-offloaded fitting choice keeps the state in the fastest tier any precision reaches (no
offload, then host memory, then NVMe): a lower precision is taken only where it moves the
state off the disk or out of host memory, or where fp32 fits nowhere.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...optim.policy import StatePolicy
from ..estimate.state import state_policy
from .candidate import Candidate, StateRow

__all__ = [
    "STATE_ROWS",
    "StateRow",
    "offload_rank",
    "pick_row",
    "policy_keys",
    "row_policies",
    "savings",
    "state_rows",
    "states_text",
]

Choice = tuple[int, str, str]  # (stage, offload_optimizer, offload_param)

STATE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("fp32", "fp32", "fp32"),
    ("bf16 moments", "bf16", "fp32"),
    ("8-bit moments", "8bit", "fp32"),
    ("8-bit moments, bf16_kahan master", "8bit", "bf16_kahan"),
    ("8-bit moments, bf16_sr master", "8bit", "bf16_sr"),
)
"""(label, moment_precision, master_precision), the highest precision first."""


def row_policies(optimizer_type: str) -> list[tuple[str, StatePolicy]]:
    """The rows the optimizer kind offers (Adagrad keeps fp32 moments: only its fp32 row)."""
    out = []
    for label, moments, master in STATE_ROWS:
        try:
            out.append((label, state_policy(optimizer_type, moments, master)))
        except ValueError:  # ConfigError: a precision this kind does not offer
            continue
    return out


def offload_rank(c: Candidate) -> int:
    """0: nothing offloaded, 1: host memory, 2: NVMe."""
    tiers = (c.estimate.optimizer_tier, c.estimate.param_tier)
    return 2 if any(t.on_nvme for t in tiers) else 1 if any(t.offloaded for t in tiers) else 0


def given_policy(
    optimizer_type: str, moment_precision: str | None, master_precision: str | None
) -> StatePolicy | None:
    """The one policy a caller asked for (a precision not given is fp32), or None."""
    if moment_precision is None and master_precision is None:
        return None
    return state_policy(optimizer_type, moment_precision or "fp32", master_precision or "fp32")


def _label(policy: StatePolicy) -> str:
    """'8bit moments, bf16_sr master': a row for precisions the caller gave."""
    return f"{policy.moments.value} moments, {policy.master.value} master"


def pick_row(rows: list[StateRow], allow_low_precision: bool) -> StateRow:
    """fp32 (the first row) unless lower precision is allowed; then the highest precision
    among those whose choice is in the fastest tier any row reaches."""
    fitting = [r for r in rows if r.choice is not None]
    if not allow_low_precision or not fitting:
        return rows[0]
    return min(fitting, key=lambda r: (offload_rank(r.choice), rows.index(r)))  # type: ignore[arg-type]


def _disk(c: Candidate) -> int:
    e = c.estimate
    return e.ranks_per_node * e.disk_bytes_per_step


def _less(saved: int) -> str:
    return f"{abs(saved) / 1e9:.1f} GB {'less' if saved >= 0 else 'more'}"


def savings(rows: list[StateRow], chosen: StateRow) -> list[str]:
    """For each lower precision that fits: its choice and what it saves against ``chosen``
    (state and host memory per node, NVMe space and disk traffic per step)."""
    gb = 1e9
    out = []
    base = chosen.choice
    for r in rows[rows.index(chosen) + 1 :]:
        c = r.choice
        if c is None:
            out.append(f"{r.describe()}: nothing fits either")
            continue
        e = c.estimate
        text = (
            f"{r.describe()}: stage {c.stage}, optimizer {c.offload_optimizer}, params "
            f"{c.offload_param}: {r.total_state_bytes / gb:.1f} GB of optimizer state in all "
            f"({(chosen.total_state_bytes - r.total_state_bytes) / gb:.1f} GB less), "
            f"host {e.host_bytes_per_node / gb:.1f} GB/node"
        )
        if base is not None:
            text += f" ({_less(base.estimate.host_bytes_per_node - e.host_bytes_per_node)})"
            if c.uses_nvme:
                nvme = base.estimate.nvme_bytes_per_node - e.nvme_bytes_per_node
                text += f", NVMe {e.nvme_bytes_per_node / gb:.1f} GB/node ({_less(nvme)})"
            else:
                text += ", no NVMe"
            if _disk(base) or _disk(c):
                text += (
                    f", disk traffic {_disk(c) / gb:.1f} GB/step/node "
                    f"({_less(_disk(base) - _disk(c))})"
                )
        out.append(text)
    return out


def policy_keys(policy: StatePolicy) -> dict[str, str]:
    """The config keywords (and ``estimate_memory``'s) of a state policy."""
    return {
        "optimizer_type": policy.kind.value,
        "moment_precision": policy.moments.value,
        "master_precision": policy.master.value,
    }


def state_rows(
    evaluate: Callable[[dict[str, Any], Choice], Candidate],
    choices: Sequence[Choice],
    est_kwargs: dict[str, Any],
    optimizer_type: str,
    trainable_params: int,
    allow_low_precision: bool,
    given: StatePolicy | None = None,
) -> tuple[list[StateRow], StateRow, dict[str, Any], list[Candidate]]:
    """A row per state precision with its least-offloaded choice that fits (``choices``
    tried in order until one fits), the row the plan takes, its estimate keywords and all
    its candidates. ``evaluate(estimate keywords, choice)`` is the planner's. ``given``: the
    one policy the caller asked for, its only row."""
    rows, tried = [], {}
    policies = row_policies(optimizer_type) if given is None else [(_label(given), given)]
    for label, policy in policies:
        kw = dict(est_kwargs, **policy_keys(policy))
        done: list[Candidate] = []
        for c in runnable(choices, policy):
            done.append(evaluate(kw, c))
            if done[-1].fits:
                break
        fit = done[-1] if done[-1].fits else None
        rows.append(StateRow(label, policy, fit, trainable_params))
        tried[label] = (kw, done)
    chosen = pick_row(rows, allow_low_precision)
    kw, done = tried[chosen.label]
    rest = runnable(choices, chosen.policy)[len(done) :]
    return rows, chosen, kw, done + [evaluate(kw, c) for c in rest]


def runnable(choices: Sequence[Choice], policy: StatePolicy) -> list[Choice]:
    """The choices the engine can run with this policy: any but fp32 AdamW is stepped by the
    CPU kernel, so not with the optimizer left on the GPU (``update.host_state.check_device``)."""
    return [c for c in choices if policy.is_default or c[1] != "none"]


def states_text(rows: list[StateRow], chosen: StateRow, allowed: bool) -> tuple[str, list[str]]:
    """The explanation's sentence on the optimizer state, and a note when a lower precision
    would need less offload than the one taken."""
    text = f" Optimizer state: {chosen.describe()}."
    if chosen is not rows[0]:
        fp32 = rows[0].choice
        text += " Lower precision allowed (allow_low_precision_states): fp32 state " + (
            f"needs stage {fp32.stage}, optimizer {fp32.offload_optimizer}, params "
            f"{fp32.offload_param}."
            if fp32 is not None
            else "fits no choice."
        )
        if fp32 is not None:
            text += f" Against it, {savings(rows, rows[0])[rows.index(chosen) - 1]}."
    better = [
        r
        for r in rows[rows.index(chosen) + 1 :]
        if r.choice is not None
        and (chosen.choice is None or offload_rank(r.choice) < offload_rank(chosen.choice))
    ]
    if allowed or not better:
        return text, []
    return text, [
        f"lower-precision optimizer state would need less offload: "
        f"{savings(rows, chosen)[rows.index(better[0]) - rows.index(chosen) - 1]}; "
        "allow it with allow_low_precision_states=True (--allow-low-precision-states); "
        "docs/optimizer_states.md says what each precision does to training"
    ]
