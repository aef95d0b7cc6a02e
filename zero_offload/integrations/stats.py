"""The engine's last-step stats as trainer log entries (TensorBoard, W&B, CSV, ...)."""

from __future__ import annotations

from typing import Any

PREFIX = "zero_offload/"


def step_stats(engine: Any) -> dict[str, float]:
    """``engine.last_step`` under ``zero_offload/`` names, and the gradient norm (before
    clipping) under the ``grad_norm`` name trainers use."""
    stats = dict(engine.last_step)
    out = {PREFIX + k: v for k, v in stats.items()}
    if "grad_norm" in stats:
        out["grad_norm"] = stats["grad_norm"]
    return out
