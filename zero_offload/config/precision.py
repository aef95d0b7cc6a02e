"""The precision section: the compute dtype and float16's dynamic loss scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import keyword
from .checks import bad, compute_dtype, number, whole_numbers

__all__ = ["PrecisionConfig"]


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute dtype of params/grads (the optimizer's master copy is ``master_precision``,
    float32 by default) and the dynamic loss scaler used with float16."""

    dtype: torch.dtype = keyword(
        torch.float32,
        "compute dtype of the parameters and gradients: float32, bfloat16 or float16 (a torch "
        "dtype or its name). The optimizer's master copy is `master_precision`: with float32 "
        "at stage 0, or at stage 3 with the shards beside the optimizer, the parameters "
        "themselves. On a CPU device without bf16 / fp16 matrix instructions (AVX512-BF16, "
        "AMX, AVX512-FP16) torch multiplies those in a reference kernel, tens of times slower "
        "than float32: the engine logs a warning there",
    )
    initial_loss_scale: float = keyword(2.0**16, "float16: the dynamic loss scale's start")
    loss_scale_window: int = keyword(1000, "float16: overflow-free steps before the scale doubles")
    min_loss_scale: float = keyword(1.0, "float16: the scale never halves below this")
    loss_scale_hysteresis: int = keyword(
        1, "float16: overflows the scale absorbs before it halves (DeepSpeed's `hysteresis`)"
    )
    consecutive_hysteresis: bool = keyword(
        False, "float16: each overflow-free step refills the hysteresis"
    )
    skip_nonfinite_steps: bool = keyword(
        False,
        "bfloat16 / float32: skip a step whose gradients hold inf or NaN (counted in "
        "`engine.skipped_steps`; float16 always does). DeepSpeed configs with `bf16` turn it "
        "on, as DeepSpeed's `check_grad_overflow`",
    )

    def __post_init__(self) -> None:
        whole_numbers(self)
        object.__setattr__(self, "dtype", compute_dtype(self.dtype))
        number("initial_loss_scale", self.initial_loss_scale, lo=0.0, lo_open=True)
        number("loss_scale_window", self.loss_scale_window, lo=1, integer=True)
        number("min_loss_scale", self.min_loss_scale, lo=0.0, lo_open=True)
        number("loss_scale_hysteresis", self.loss_scale_hysteresis, lo=1, integer=True)
        for key in ("consecutive_hysteresis", "skip_nonfinite_steps"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, getattr(self, key), "expected True or False")
