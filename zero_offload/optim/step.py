"""The functional optimizer step over a span of state, for every kind and precision.

``step(state, grad, hyper)`` is what the engine's updaters and the optimizer classes call:
the state tensors are the caller's (host shard, NVMe pipeline buffer), nothing is copied,
and the update runs in one pass in the C kernel when it is built, else in torch
(:mod:`.torch_step`). fp32 Adam(W) goes to the original Adam kernel
(:func:`.native.adam_kernel.adam_update`), so the default configuration computes exactly what
it always has.
"""

from __future__ import annotations

import logging

import torch
from torch.profiler import record_function

from .hyper import StepHyper
from .native.adam_kernel import adam_update, kernel_threads
from .native.optim_kernel import get_optim_kernel, native_step
from .policy import MasterPrecision, MomentPrecision, OptimizerKind
from .state import ShardState
from .torch_step import torch_step

__all__ = ["step", "StepHyper"]

logger = logging.getLogger(__name__)

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU tensor (got {t.device}, strides {t.stride()})"
        )
    if t.dtype not in dtypes:
        raise TypeError(
            f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, dtypes))}"
        )
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, the span has {numel}")


def check_state(state: ShardState, grad: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise a clear error for anything the in-place step cannot take as is."""
    n = state.span.numel
    _check("grad", grad, _GRAD_DTYPES, n)
    if out is not None:
        _check("out", out, _OUT_DTYPES, n)
    for name, t in state.tensors():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"state {name!r} must be a contiguous CPU tensor")


def _fp32_adam(state: ShardState) -> bool:
    pol = state.policy
    return (
        pol.kind in (OptimizerKind.ADAMW, OptimizerKind.ADAM)
        and pol.moments is MomentPrecision.FP32
        and pol.master is MasterPrecision.FP32
    )


@record_function("zero_offload.optim_step")
def step(
    state: ShardState,
    grad: torch.Tensor,
    hyper: StepHyper,
    *,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
    index_base: int | None = None,
) -> None:
    """One optimizer step, in place, on every element of ``state.span``.

    ``grad``: the span's gradients (fp32, bf16 or fp16), widened and multiplied by
    ``hyper.grad_scale`` in registers, never written. ``out``: receives the new parameter
    values in its dtype in the same pass (a bf16 master's own bits when ``out`` is bf16).
    ``index_base``: the global index of the span's first element, keying the stochastic
    rounding streams (default: the span's start in its run), so a result does not depend on
    how a run is cut into calls or threads. ``num_threads``: default physical cores.
    """
    check_state(state, grad, out)
    n = state.span.numel
    if n == 0 or not state.master.untyped_storage().data_ptr():
        return  # nothing to do, or a rehearsal's fake tensor (no values, nothing allocated)
    if _fp32_adam(state) and (out is None or out.dtype != torch.float32):
        m, v = state.moments["exp_avg"].values, state.moments["exp_avg_sq"].values
        adam_update(
            state.master,
            grad,
            m,
            v,
            step=hyper.step,
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            adamw=state.policy.kind is OptimizerKind.ADAMW,
            out=out,
            num_threads=num_threads,
            grad_scale=hyper.grad_scale,
        )
        return
    base = state.span.lo if index_base is None else int(index_base)
    k = get_optim_kernel()
    if k is not None:
        rc = native_step(k, state, grad, hyper, out, kernel_threads(num_threads, n), base)
        if rc == 0:
            return
        # the kernel validates before touching memory: nothing was updated
        logger.warning("CPU optimizer kernel returned %d; doing this step in torch", rc)
    torch_step(state, grad, hyper, out, base)
