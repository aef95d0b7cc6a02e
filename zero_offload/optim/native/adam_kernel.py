"""ctypes binding of ``kernels/cpu_adam.c``: the functional Adam update on flat
CPU tensors.

Why a functional API: the engine updates flat fp32 master shards whose m and v may live in
NVMe swap buffers rather than in ``optimizer.state``, so it calls :func:`adam_update` on
tensors it owns. The optimizer classes are thin wrappers over the same call.

The kernel is compiled on first use, on the code path ``ZERO_OFFLOAD_ISA`` asks for
(:mod:`.build`). Without a compiler, or when the build fails, one warning is logged and
torch's fused CPU Adam(W) does the update (same math, same results within a few ulp).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import TypedDict

import numpy as np
import psutil
import torch
from torch import Tensor
from torch.profiler import record_function

from ...errors import IsaUnavailable, KernelBuildError
from .build import (
    ISAS,
    NativeKernel,
    build_kernel,
    check_path,
    chosen_kernel,
    kernel_isa,
    run_in_parts,
)

logger = logging.getLogger(__name__)

__all__ = ["ISAS", "IsaUnavailable", "adam_update", "default_num_threads", "kernel_status"]

KERNEL_NAME = "cpu_adam"
ABI_VERSION = 3
NUM_HP = 11
# Below this many elements per thread, extra threads cost more than they bring.
MIN_ELEMS_PER_THREAD = 1 << 16
ALIGN_ELEMS = 64

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_OUT = -1


class AdamHyper(TypedDict):
    """One step's hyperparameters, as :func:`adam_scalars` and :func:`torch_update` take them."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool
    grad_scale: float  # the gradients' factor (unscale, clip), applied in fp32 by the kernel


@functools.lru_cache(maxsize=1)
def default_num_threads() -> int:
    """Physical cores: the step is memory bound and SMT siblings share the same bandwidth.
    (Read once: psutil scans sysfs on every call, ~2 ms, and every step asks.)"""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def kernel_threads(num_threads: int | None, n: int) -> int:
    """Threads for one kernel call over ``n`` elements: ``num_threads`` (default
    :func:`default_num_threads`), fewer where each would get under ``MIN_ELEMS_PER_THREAD``."""
    threads = default_num_threads() if num_threads is None else int(num_threads)
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    return max(1, min(threads, n // MIN_ELEMS_PER_THREAD))


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    hp = ctypes.POINTER(f32)  # the hyperparameters: float[NUM_HP], then NUM_HP
    lib.zo_abi_version.restype = i32
    lib.zo_num_hp.restype = i32
    lib.zo_has_openmp.restype = i32
    lib.zo_vec_path.restype = ctypes.c_char_p
    lib.zo_adam_range.restype = i32
    lib.zo_adam_range.argtypes = [ptr, ptr, i32, ptr, ptr, ptr, i32, i64, i64, hp, i32]
    lib.zo_adam_omp.restype = i32
    lib.zo_adam_omp.argtypes = [ptr, ptr, i32, ptr, ptr, ptr, i32, i64, hp, i32, i32]


def load_kernel(isa: str | None = None) -> NativeKernel:
    """Build (or find cached) and load the Adam kernel for one code path, uncached.

    Raises :class:`IsaUnavailable` when this CPU has no such path and
    :class:`KernelBuildError` when there is no compiler or the build fails.
    """
    isa = kernel_isa(isa)
    lib = build_kernel(KERNEL_NAME, isa)
    try:
        _declare(lib)
        abi = lib.zo_abi_version(), lib.zo_num_hp()
    except AttributeError as exc:  # a missing symbol: a library from another version
        raise KernelBuildError(f"kernel library lacks a symbol: {exc}") from exc
    if abi != (ABI_VERSION, NUM_HP):
        raise KernelBuildError(
            f"kernel ABI {abi[0]} does not match the binding's {ABI_VERSION}: "
            "kernels/ and the binding come from different versions "
            "(reinstall zero_offload)"
        )
    return check_path(isa, NativeKernel(lib, bool(lib.zo_has_openmp()), lib.zo_vec_path().decode()))


@functools.lru_cache(maxsize=None)
def _load_cached(cc: str, cache: str, isa: str) -> NativeKernel | KernelBuildError:
    """Keyed by compiler, cache folder and code path so a changed ``CC`` or
    ``ZERO_OFFLOAD_ISA`` gets a fresh attempt; a failure is cached so it is warned about
    once, not on every step."""
    try:
        native = load_kernel(isa)
    except (KernelBuildError, OSError) as exc:
        logger.warning(
            "CPU Adam kernel unavailable, falling back to torch's fused CPU AdamW "
            "(slower on the bf16 offload path). Reason: %s",
            exc,
        )
        return exc if isinstance(exc, KernelBuildError) else KernelBuildError(str(exc))
    logger.info(
        "CPU Adam kernel loaded (%s, openmp=%s, cache %s)", native.vec_path, native.openmp, cache
    )
    return native


def get_kernel(isa: str | None = None) -> NativeKernel | None:
    """The native kernel for ``isa`` (default ``ZERO_OFFLOAD_ISA``), or None when disabled
    or unavailable (``ZERO_OFFLOAD_KERNELS=required`` raises the build's error instead)."""
    return chosen_kernel(_load_cached, isa)


def kernel_status() -> str:
    """One line for logs and benchmarks: which implementation updates run on."""
    k = get_kernel()
    if k is None:
        return "torch fused fallback"
    return f"native ({k.vec_path}, {'openmp' if k.openmp else 'python threads'})"


def _check(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; CPU Adam needs {allowed}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); the "
            "update is done in place, so pass contiguous storage (e.g. a flat shard)"
        )
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, param has {numel}")


def check_tensors(
    param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, out: Tensor | None = None
) -> None:
    """Raise a clear error for anything the in-place update cannot take as is."""
    fp32 = (torch.float32,)
    _check("param", param, fp32, param.numel() if isinstance(param, Tensor) else 0)
    n = param.numel()
    _check("grad", grad, tuple(_DTYPE_CODES), n)
    _check("exp_avg", exp_avg, fp32, n)
    _check("exp_avg_sq", exp_avg_sq, fp32, n)
    if out is not None:
        _check("out", out, (torch.bfloat16, torch.float16), n)


def _f32(x: float) -> float:
    return float(np.float32(x))


def adam_scalars(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float = 1.0,
) -> tuple[ctypes.Array, int]:
    """Fold the hyperparameters in double precision like torch's Python-side math; the
    kernel takes them as ``float[NUM_HP]`` (order of ``zo_hp`` in the C source).
    ``grad_scale``: the factor the kernel multiplies each (widened) gradient by, in fp32."""
    bc1 = 1 - beta1**step
    bc2_sqrt = (1 - beta2**step) ** 0.5
    w1 = _f32(1 - beta1)
    values = (
        1 - lr * weight_decay if adamw else 1.0,  # decay
        0.0 if adamw else weight_decay,  # l2
        w1,
        _f32(np.float32(1.0) - np.float32(w1)),  # torch lerp's (1 - weight) in fp32
        beta2,
        1 - beta2,
        eps,
        -(lr / bc1),  # -step_size
        bc2_sqrt,
        float(np.float32(1.0) / np.float32(bc2_sqrt)),  # correctly rounded fp32 reciprocal
        grad_scale,
    )
    return (ctypes.c_float * NUM_HP)(*values), int(bool(adamw))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def native_update(
    k: NativeKernel,
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    out: Tensor | None,
    scalars: tuple,
    threads: int,
    openmp: bool | None = None,
) -> int:
    """Run the kernel on ``threads`` threads (OpenMP when built with it, else Python threads
    calling disjoint ranges without the GIL); returns the kernel's status code. Tensors must
    already have passed :func:`check_tensors`."""
    n = param.numel()
    args = [
        _ptr(param),
        _ptr(grad),
        _DTYPE_CODES[grad.dtype],
        _ptr(exp_avg),
        _ptr(exp_avg_sq),
        _ptr(out),
        _NO_OUT if out is None else _DTYPE_CODES[out.dtype],
    ]
    if threads == 1 or (k.openmp if openmp is None else openmp):
        return k.lib.zo_adam_omp(*args, n, *scalars, threads)
    per = -(-n // threads)
    per = -(-per // ALIGN_ELEMS) * ALIGN_ELEMS
    ranges = [(b, min(b + per, n)) for b in range(0, n, per)]
    codes = [0] * len(ranges)

    def work(j: int) -> None:
        codes[j] = k.lib.zo_adam_range(*args, ranges[j][0], ranges[j][1], *scalars)

    run_in_parts(work, len(ranges))
    return max(codes, key=abs)


def torch_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    out: Tensor | None,
    grad_scale: float = 1.0,
) -> None:
    """torch's fused CPU Adam(W) on the same tensors (grad widened to fp32 first)."""
    g = grad if grad.dtype == torch.float32 else grad.float()
    if grad_scale != 1.0:
        g = g * _f32(grad_scale)  # a new tensor: the caller's gradients stay as they are
    fn = torch._fused_adamw_ if adamw else torch._fused_adam_
    fn(
        [param],
        [g],
        [exp_avg],
        [exp_avg_sq],
        [],
        [torch.tensor(float(step))],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )
    if out is not None:
        out.view(-1).copy_(param.view(-1))


@record_function("zero_offload.cpu_adam")
def adam_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    out: Tensor | None = None,
    num_threads: int | None = None,
    grad_scale: float = 1.0,
) -> None:
    """One Adam/AdamW step in place on ``param``, ``exp_avg``, ``exp_avg_sq``.

    ``step`` is the already-incremented step count (bias correction). ``grad`` may be
    fp32, bf16 or fp16; it is widened and multiplied by ``grad_scale`` (rounded to fp32:
    the loss-scale and clipping factor) in registers, so the gradients are read once and
    never written. ``out`` (bf16/fp16) receives the updated param rounded to nearest
    even in the same pass. Tensors must be contiguous CPU tensors of equal numel; nothing
    is ever copied, so a wrong tensor raises instead of updating a hidden copy.
    """
    check_tensors(param, grad, exp_avg, exp_avg_sq, out)
    if step < 1:
        raise ValueError(f"step must be the incremented step count (>= 1), got {step}")
    n = param.numel()
    if n == 0:
        return
    hyper = AdamHyper(
        step=int(step),
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        adamw=bool(adamw),
        grad_scale=_f32(grad_scale),
    )
    if not param.untyped_storage().data_ptr():
        # A tensor without memory (a rehearsal's fake tensor) has no values to update, and
        # the kernel it stands for allocates nothing: torch's path would count a widened
        # copy of the gradients that a real run never makes.
        return
    k = get_kernel()
    if k is not None:
        threads = kernel_threads(num_threads, n)
        rc = native_update(k, param, grad, exp_avg, exp_avg_sq, out, adam_scalars(**hyper), threads)
        if rc == 0:
            return
        # The kernel validates before touching memory: nothing was updated, do it in torch.
        logger.warning("CPU Adam kernel returned %d; doing this update with torch", rc)
    torch_update(param, grad, exp_avg, exp_avg_sq, out=out, **hyper)
