"""Tensors on the wrong side of the PCIe link: where a rehearsed engine's state and the model's
parameters and buffers must be, checked after ``initialize`` and after the last step."""

from __future__ import annotations

from typing import Any

import torch


def _tier_of(offload: str) -> str:
    return "cpu" if offload != "none" else "device"


def device_problems(engine: Any, when: str) -> list[str]:
    """Tensors on the wrong side of the PCIe link: the engine's state must be where its
    configuration puts it (the device unless offloaded), and the model's parameters and
    buffers on the device."""
    sim = engine.device.type
    out = []

    def check(what: str, t: torch.Tensor | None, want: str) -> None:
        if t is None:
            return
        want_type = sim if want == "device" else "cpu"
        if t.device.type != want_type:
            out.append(
                f"{when}: {what} is on {t.device.type}, expected "
                f"{'the GPU' if want == 'device' else 'the host'}"
            )

    cfg = engine.config
    for name, p in engine.module.named_parameters():
        check(f"parameter {name}", p, "device")
    for name, b in engine.module.named_buffers():
        check(f"buffer {name}", b, "device")
    held = engine.held_tensors()
    for i, full in enumerate(held["units"] + held["gathered"]):
        check(f"flat parameter buffer {i}", full, "device")
    for t in held["grad_shard"]:
        check("the gradient shard", t, _tier_of(cfg.offload.optimizer))
    for t in held["param_shards"]:
        check("the parameter shards", t, _tier_of(cfg.offload.param))
    check(
        "the fp32 master", engine.optimizer_tensors().get("master"), _tier_of(cfg.offload.optimizer)
    )
    return out
