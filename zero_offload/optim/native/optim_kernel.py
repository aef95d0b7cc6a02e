"""ctypes binding of ``kernels/cpu_optim.c``: the step for every optimizer kind and state
precision over a span's work rows.

Built, cached, checked and chosen like the Adam kernel (:mod:`.build`: the same
``ZERO_OFFLOAD_KERNELS`` and ``ZERO_OFFLOAD_ISA`` switches; the same ABI check as
:mod:`.adam_kernel`); without a compiler :func:`get_optim_kernel` returns None and the step
runs in torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import torch

from ...errors import KernelBuildError
from ..hyper import NUM_SCALARS, StepHyper, fold_scalars
from ..layout import ROW_FIELDS
from ..policy import MasterPrecision, MomentPrecision, OptimizerKind
from ..quant import (
    byte_planes,
    dynamic_map,
    lookup_table,
    negative_offset,
    span_lines,
    threshold_words,
)
from ..rounding import STREAMS, stream_seed
from ..state import ShardState
from .build import (
    NativeKernel,
    build_kernel,
    check_path,
    chosen_kernel,
    kernel_isa,
    run_in_parts,
)

logger = logging.getLogger(__name__)

KERNEL_NAME = "cpu_optim"
ABI_VERSION = 2
NUM_PTRS = 10
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_KINDS = {
    OptimizerKind.ADAMW: 0,
    OptimizerKind.ADAM: 1,
    OptimizerKind.LION: 2,
    OptimizerKind.ADAGRAD: 3,
}
_MOMENTS = {MomentPrecision.FP32: 0, MomentPrecision.BF16: 1, MomentPrecision.INT8: 2}
_MASTERS = {MasterPrecision.FP32: 0, MasterPrecision.BF16_KAHAN: 1, MasterPrecision.BF16_SR: 2}


class QMap(ctypes.Structure):
    """``zo_qmap``: a map's values and its lookup (arrays kept alive by :class:`_Maps`)."""

    _fields_ = [
        ("values", ctypes.c_void_p),
        ("lut", ctypes.c_void_p),
        ("shift", ctypes.c_int32),
        ("buckets", ctypes.c_int32),
        ("value_planes", ctypes.c_void_p),
        ("thr_planes", ctypes.c_void_p),
        ("lines", ctypes.c_void_p),
        ("neg_k", ctypes.c_float),
    ]


class _Maps:
    """Both maps, built once per process."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.signed = self._make(True)
        self.unsigned = self._make(False)

    def _make(self, signed: bool) -> QMap:
        values = np.ascontiguousarray(dynamic_map(signed).numpy())
        lut, shift, buckets = lookup_table(signed)
        lut = np.ascontiguousarray(lut)
        vplanes = np.ascontiguousarray(byte_planes(values))
        tplanes = np.ascontiguousarray(byte_planes(threshold_words(signed)))
        lines = np.ascontiguousarray(span_lines(signed))
        self.arrays += [values, lut, vplanes, tplanes, lines]
        return QMap(
            values.ctypes.data,
            lut.ctypes.data,
            shift,
            buckets,
            vplanes.ctypes.data,
            tplanes.ctypes.data,
            lines.ctypes.data,
            negative_offset(signed),
        )


@functools.lru_cache(maxsize=1)
def maps() -> _Maps:
    return _Maps()


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name in ("zo_optim_abi_version", "zo_optim_num_scalars", "zo_optim_num_ptrs"):
        getattr(lib, name).restype = i32
    lib.zo_optim_has_openmp.restype = i32
    lib.zo_optim_vec_path.restype = ctypes.c_char_p
    lib.zo_optim_rows.restype = i32
    lib.zo_optim_rows.argtypes = [p, p, i64, i64, p, p, p, i64, p, p]
    lib.zo_optim_omp.restype = i32
    lib.zo_optim_omp.argtypes = [p, p, i64, p, p, p, i64, p, p, i32]
    lib.zo_optim_quantize.restype = None
    lib.zo_optim_quantize.argtypes = [p, i64, p, p]
    lib.zo_optim_code_mismatches.restype = i64
    lib.zo_optim_code_mismatches.argtypes = [p, i64, i64, i32]


def load_optim_kernel(isa: str | None = None) -> NativeKernel:
    """Build (or find cached) and load the kernel for one code path, uncached; raises as
    :func:`.adam_kernel.load_kernel` does."""
    isa = kernel_isa(isa)
    lib = build_kernel(KERNEL_NAME, isa)
    try:
        _declare(lib)
        abi = (lib.zo_optim_abi_version(), lib.zo_optim_num_scalars(), lib.zo_optim_num_ptrs())
    except AttributeError as exc:
        raise KernelBuildError(f"kernel library lacks a symbol: {exc}") from exc
    if abi != (ABI_VERSION, NUM_SCALARS, NUM_PTRS):
        raise KernelBuildError(
            f"optimizer kernel ABI {abi} does not match the binding's "
            f"{(ABI_VERSION, NUM_SCALARS, NUM_PTRS)}: kernels/ and the binding come from "
            "different versions (reinstall zero_offload)"
        )
    native = NativeKernel(lib, bool(lib.zo_optim_has_openmp()), lib.zo_optim_vec_path().decode())
    return check_path(isa, native)


@functools.lru_cache(maxsize=None)
def _load_cached(cc: str, cache: str, isa: str) -> NativeKernel | KernelBuildError:
    try:
        native = load_optim_kernel(isa)
    except (KernelBuildError, OSError) as exc:
        logger.warning("CPU optimizer kernel unavailable, stepping in torch (slower): %s", exc)
        return exc if isinstance(exc, KernelBuildError) else KernelBuildError(str(exc))
    logger.info("CPU optimizer kernel loaded (%s, openmp=%s)", native.vec_path, native.openmp)
    return native


def get_optim_kernel(isa: str | None = None) -> NativeKernel | None:
    """The kernel for ``isa`` (default ``ZERO_OFFLOAD_ISA``), or None when disabled or
    unavailable (``ZERO_OFFLOAD_KERNELS=required`` raises instead)."""
    return chosen_kernel(_load_cached, isa)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def native_step(
    k: NativeKernel,
    state: ShardState,
    grad: torch.Tensor,
    hyper: StepHyper,
    out: torch.Tensor | None,
    threads: int,
    index_base: int,
    rows: np.ndarray | None = None,
) -> int:
    """Run the kernel over the span's rows on ``threads`` threads; returns its status code."""
    pol = state.policy
    names = pol.moment_names
    m = state.moments[names[0]]
    v = state.moments[names[1]] if len(names) > 1 else None
    ptr_values = [
        _ptr(state.master),
        _ptr(state.compensation),
        _ptr(grad),
        _ptr(out),
        _ptr(m.values),
        None if v is None else _ptr(v.values),
        _ptr(m.absmax),
        None if v is None else _ptr(v.absmax),
        _ptr(m.side),
        None if v is None else _ptr(v.side),
    ]
    ptrs = (ctypes.c_void_p * NUM_PTRS)(*ptr_values)
    modes = (ctypes.c_int32 * 5)(
        _KINDS[pol.kind],
        _MOMENTS[pol.moments],
        _MASTERS[pol.master],
        _DTYPES[grad.dtype],
        -1 if out is None else _DTYPES[out.dtype],
    )
    keys = (ctypes.c_uint32 * 3)(
        stream_seed(hyper.seed, hyper.step, STREAMS["master"]),
        stream_seed(hyper.seed, hyper.step, STREAMS["moments"]),
        0,  # reserved
    )
    hp = fold_scalars(pol.kind, hyper)
    table = np.ascontiguousarray(state.span.rows() if rows is None else rows, dtype=np.int64)
    assert table.ndim == 2 and table.shape[1] == len(ROW_FIELDS)
    nrows = table.shape[0]
    q = maps()
    qm = ctypes.byref(q.signed if pol.kind.signed_moments[0] else q.unsigned)
    qv = ctypes.byref(q.unsigned)
    rows_p = table.ctypes.data
    common = (modes, hp, keys, int(index_base), qm, qv)
    if threads <= 1 or k.openmp or nrows <= 1:
        return k.lib.zo_optim_omp(ptrs, rows_p, nrows, *common, max(1, threads))
    per = -(-nrows // threads)
    parts = [(a, min(a + per, nrows)) for a in range(0, nrows, per)]
    codes = [0] * len(parts)

    def work(j: int) -> None:
        codes[j] = k.lib.zo_optim_rows(ptrs, rows_p, parts[j][0], parts[j][1], *common)

    run_in_parts(work, len(parts))
    return max(codes, key=abs)


def native_quantize(k: NativeKernel, x: torch.Tensor, signed: bool) -> torch.Tensor:
    """The kernel's codes for fp32 values ``x`` (already normalized by their absmax)."""
    x = x.contiguous().float()
    out = torch.empty(x.numel(), dtype=torch.uint8)
    q = maps()
    k.lib.zo_optim_quantize(
        x.data_ptr(), x.numel(), ctypes.byref(q.signed if signed else q.unsigned), out.data_ptr()
    )
    return out


def code_mismatches(
    k: NativeKernel, signed: bool, first: int = 0, count: int = 1 << 32, threads: int = 1
) -> int:
    """How many fp32 bit patterns ``first .. first + count - 1`` the path's block quantizer
    codes differently from the scalar reference rule (0 over all 2**32 is the exhaustive
    check of docs/optimizer_states.md)."""
    q = maps()
    qm = ctypes.byref(q.signed if signed else q.unsigned)
    return int(k.lib.zo_optim_code_mismatches(qm, first, count, max(1, threads)))
