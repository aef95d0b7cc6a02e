"""Tensors on the wrong side of the PCIe link: where a rehearsed engine's state and the model's
parameters and buffers must be, checked after ``initialize`` and after the last step."""

from __future__ import annotations

from typing import Any

import torch

from ..policies import Tier


def device_problems(engine: Any, when: str) -> list[str]:
    """Tensors on the wrong side of the PCIe link: the engine's state must be where its
    configuration puts it (the device unless offloaded), and the model's parameters and
    buffers on the device."""
    sim = engine.device.type
    out = []

    def check(what: str, t: torch.Tensor | None, want: Tier) -> None:
        """``want``: an offloaded tier is host memory (NVMe state is read into it)."""
        if t is None:
            return
        want_type = "cpu" if want.offloaded else sim
        if t.device.type != want_type:
            out.append(
                f"{when}: {what} is on {t.device.type}, expected "
                f"{'the host' if want.offloaded else 'the GPU'}"
            )

    cfg = engine.config
    for name, p in engine.module.named_parameters():
        check(f"parameter {name}", p, Tier.DEVICE)
    for name, b in engine.module.named_buffers():
        check(f"buffer {name}", b, Tier.DEVICE)
    held = engine.held_tensors()
    for i, full in enumerate(held["units"] + held["gathered"]):
        check(f"flat parameter buffer {i}", full, Tier.DEVICE)
    for t in held["grad_shard"]:
        check("the gradient shard", t, cfg.offload.optimizer_tier)
    for t in held["param_shards"]:
        check("the parameter shards", t, cfg.offload.param_tier)
    check("the fp32 master", engine.optimizer_tensors().get("master"), cfg.offload.optimizer_tier)
    return out
