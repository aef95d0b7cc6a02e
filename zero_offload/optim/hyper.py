"""One step's hyperparameters for every optimizer kind, and their folding into the
kernel's fp32 scalars (in double precision first, like torch's Python-side math)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .policy import OptimizerKind

__all__ = ["StepHyper", "NUM_SCALARS", "fold_scalars"]

DEFAULT_SEED = 0x5EED


@dataclass(frozen=True)
class StepHyper:
    """``step``: the already-incremented step count (bias correction, Adagrad's lr decay,
    the stochastic-rounding streams). ``betas``: Adam's (beta1, beta2); Lion's (beta1: the
    update's interpolation, beta2: the momentum's); unused by Adagrad. ``weight_decay``:
    decoupled for AdamW and Lion, added to the gradient for Adam and Adagrad.
    ``grad_scale``: multiplies each widened gradient first, in fp32 (unscale, clip).
    ``seed``: keys the stochastic rounding (bf16 moments, ``bf16_sr`` master)."""

    step: int
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_scale: float = 1.0
    lr_decay: float = 0.0  # Adagrad: lr / (1 + (step - 1) * lr_decay), as torch's Adagrad
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if int(self.step) < 1:
            raise ValueError(f"step must be the incremented step count (>= 1), got {self.step}")

    @classmethod
    def from_group(cls, group: Mapping[str, Any], step: int, grad_scale: float = 1.0) -> StepHyper:
        """A torch optimizer param group's hyperparameters (what lr schedulers change) for
        step ``step``; a 0-dim tensor lr or beta is read as its value."""
        beta1, beta2 = group["betas"]
        return cls(
            step=step,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            grad_scale=float(grad_scale),
            lr_decay=float(group.get("lr_decay", 0.0)),
        )


def _f32(x: float) -> float:
    return float(np.float32(x))


# order of zo_scalars in kernels/cpu_optim.c
_FIELDS = (
    "decay",  # 1 - lr * wd where decay is decoupled (AdamW, Lion), else 1
    "l2",  # wd where it is added to the gradient (Adam, Adagrad), else 0
    "w1",  # Adam: lerp weight 1 - beta1
    "one_minus_w1",  # fp32(1 - fp32(w1)): torch lerp's other branch
    "beta1",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "eps",
    "neg_step",  # Adam: -lr / (1 - beta1^step); Lion: -lr; Adagrad: -lr / (1 + (step-1) lr_decay)
    "bc2_sqrt",  # Adam: sqrt(1 - beta2^step)
    "inv_bc2_sqrt",  # fp32(1 / fp32(bc2_sqrt))
    "grad_scale",
)
NUM_SCALARS = len(_FIELDS)


def fold_scalars(kind: OptimizerKind, h: StepHyper) -> ctypes.Array:
    """The kernel's ``float[NUM_SCALARS]`` for one step."""
    step = int(h.step)
    decoupled = kind.decoupled_decay
    bc2_sqrt = (
        (1 - h.beta2**step) ** 0.5 if kind in (OptimizerKind.ADAMW, OptimizerKind.ADAM) else 1.0
    )
    if kind is OptimizerKind.LION:
        neg_step = -h.lr
    elif kind is OptimizerKind.ADAGRAD:
        neg_step = -(h.lr / (1 + (step - 1) * h.lr_decay))
    else:
        neg_step = -(h.lr / (1 - h.beta1**step))
    w1 = _f32(1 - h.beta1)
    values = {
        "decay": 1 - h.lr * h.weight_decay if decoupled else 1.0,
        "l2": 0.0 if decoupled else h.weight_decay,
        "w1": w1,
        "one_minus_w1": _f32(np.float32(1.0) - np.float32(w1)),
        "beta1": h.beta1,
        "one_minus_beta1": 1 - h.beta1,
        "beta2": h.beta2,
        "one_minus_beta2": 1 - h.beta2,
        "eps": h.eps,
        "neg_step": neg_step,
        "bc2_sqrt": bc2_sqrt,
        "inv_bc2_sqrt": float(np.float32(1.0) / np.float32(bc2_sqrt)),
        "grad_scale": h.grad_scale,
    }
    return (ctypes.c_float * NUM_SCALARS)(*(values[k] for k in _FIELDS))
