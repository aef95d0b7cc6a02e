"""Compile the C kernels in ``kernels/`` on first use, load them with ctypes, and choose
which of their code paths runs.

Why: the kernels are built for the exact CPU they run on (``-march=native``), so they cannot
ship prebuilt. A build is cached per user under a name keyed by the source, the flags, the
compiler version and the CPU, so a changed source, compiler or machine (a shared home on a
different node) gets its own library; builds are atomic so several ranks starting at once
are safe.

Environment:
    ``CC``: the C compiler (default ``cc``).
    ``ZERO_OFFLOAD_CACHE``: the cache folder (default ``~/.cache/zero_offload``).
    ``ZERO_OFFLOAD_KERNELS``: ``auto`` (default: torch where a kernel does not build),
    ``off`` (always torch), ``required`` (a failed build raises ``KernelBuildError``).
    ``ZERO_OFFLOAD_ISA``: the code path, ``auto`` (default: the best this CPU has),
    ``avx512``, ``avx2`` or ``scalar``. Each is built from ``-march=native`` minus
    instruction sets (never plus), so a path the CPU lacks cannot be built; asking for it is
    an :class:`IsaUnavailable` error (in ``auto`` mode: a warning and torch). All paths give
    bit-identical results; the choice exists to test each one and to compare their speed.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ...errors import IsaUnavailable, KernelBuildError

logger = logging.getLogger(__name__)

BASE_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300
KERNEL_FLAGS: tuple[str, ...] = ("-ffp-contract=off", "-fno-math-errno")
OPENMP_FLAGS: tuple[str, ...] = ("-fopenmp",)
ENV_MODE = "ZERO_OFFLOAD_KERNELS"
MODES = ("auto", "off", "required")
ENV_ISA = "ZERO_OFFLOAD_ISA"
ISAS = ("auto", "avx512", "avx2", "scalar")
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@dataclass(frozen=True)
class NativeKernel:
    """A loaded kernel library and what it was built with."""

    lib: ctypes.CDLL
    openmp: bool
    vec_path: str


def kernels_dir() -> Path:
    """Where the C sources live: ``kernels/`` beside the package in a source tree (a checkout
    on ``sys.path`` or installed in editable mode), else the data package
    ``zero_offload._kernels`` that the wheel ships them as."""
    source = Path(__file__).resolve().parents[3] / "kernels"
    if (source / "cpu_adam.c").is_file():
        return source
    spec = importlib.util.find_spec("zero_offload._kernels")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise KernelBuildError("the kernel sources are missing: reinstall zero_offload")


def cache_dir() -> Path:
    """The per-user build cache (``$ZERO_OFFLOAD_CACHE`` or ``~/.cache/zero_offload``)."""
    env = os.environ.get("ZERO_OFFLOAD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zero_offload"


def compiler() -> list[str]:
    """The compiler command (``$CC`` may carry arguments, e.g. ``ccache gcc``)."""
    return shlex.split(os.environ.get("CC", "cc")) or ["cc"]


def _compiler_version(cc: list[str]) -> str:
    if shutil.which(cc[0]) is None:
        raise KernelBuildError(
            f"no C compiler: {cc[0]!r} not found on PATH (install gcc or clang, or set CC)"
        )
    try:
        res = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"C compiler {cc[0]!r} does not run: {exc}") from exc
    if res.returncode != 0:
        raise KernelBuildError(f"C compiler {cc[0]!r} does not run: {res.stderr.strip()}")
    return res.stdout.strip()


def _cpu_signature() -> str:
    """Model name and flags: -march=native output depends on both."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = []
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags", "Features", "CPU part") and line not in keep:
            keep.append(line)
    return "\n".join(keep)


def _build(cc: list[str], src: Path, flags: Sequence[str], target: Path) -> None:
    """Compile to a temporary name in the cache folder, then rename into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    cmd = cc + list(flags) + [str(src), "-o", tmp, "-lm"]
    logger.info("building kernel: %s", " ".join(cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if res.returncode != 0:
            raise KernelBuildError(
                f"compiling {src.name} failed ({' '.join(cmd)}):\n{res.stderr.strip()}"
            )
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"compiling {src.name} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(name: str, extra_flags: Sequence[str] = ()) -> Path:
    """The cached library for ``kernels/<name>.c``, built first if missing."""
    src = kernels_dir() / f"{name}.c"
    if not src.is_file():
        raise KernelBuildError(f"kernel source not found: {src}")
    cc = compiler()
    flags = BASE_FLAGS + tuple(extra_flags)
    key = hashlib.sha256()
    for part in (
        src.read_bytes(),
        " ".join(cc).encode(),
        " ".join(flags).encode(),
        _compiler_version(cc).encode(),
        _cpu_signature().encode(),
    ):
        key.update(part)
        key.update(b"\0")
    target = cache_dir() / f"{name}-{key.hexdigest()[:20]}.so"
    if not target.exists():
        _build(cc, src, flags, target)
    return target


def load_library(name: str, extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Compile ``kernels/<name>.c`` if needed (cached) and load it.

    Raises KernelBuildError (with the compiler's stderr) when there is no compiler, the
    build fails, or the built library does not load.
    """
    path = library_path(name, extra_flags)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"built kernel {path} does not load: {exc}") from exc


def kernel_mode() -> str:
    """``ZERO_OFFLOAD_KERNELS``, validated."""
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def kernel_isa(isa: str | None = None) -> str:
    """The code path asked for: ``isa`` or else ``ZERO_OFFLOAD_ISA``, validated."""
    value = os.environ.get(ENV_ISA, "auto") if isa is None else isa
    value = value.strip().lower() or "auto"
    if value not in ISAS:
        raise ValueError(f"{ENV_ISA}={value!r} is not one of {', '.join(ISAS)}")
    return value


def isa_flags(isa: str) -> tuple[str, ...]:
    """Flags after ``-march=native`` that select a path. They only take instruction sets
    away, so a build never contains one the CPU lacks (which would crash, not fail)."""
    if isa == "avx2":
        return ("-mno-avx512f",)  # drops every AVX-512 subset: the portable loop, in AVX2
    if isa == "scalar":
        x86 = ("-mno-avx", "-mno-fma", "-mno-f16c") if X86 else ()
        return x86 + ("-fno-tree-vectorize", "-DZO_SCALAR")
    return ()


def build_kernel(name: str, isa: str) -> ctypes.CDLL:
    """Build (or find cached) and load kernel ``name`` for code path ``isa`` (validated by
    :func:`kernel_isa`); OpenMP if the toolchain links it. Raises :class:`IsaUnavailable`
    for an x86-64 path on another CPU."""
    if isa in ("avx512", "avx2") and not X86:
        raise IsaUnavailable(
            f"{ENV_ISA}={isa}: an x86-64 path, and this CPU is "
            f"{platform.machine()}; use auto or scalar"
        )
    flags = KERNEL_FLAGS + isa_flags(isa)
    try:
        return load_library(name, flags + OPENMP_FLAGS)
    except KernelBuildError as exc:
        if "no C compiler" in str(exc):
            raise
        logger.info("building %s with OpenMP failed, trying without: %s", name, exc)
        return load_library(name, flags)


def check_path(isa: str, native: NativeKernel) -> NativeKernel:
    """``native`` when it runs the path asked for (any, for ``auto``)."""
    if isa != "auto" and native.vec_path != isa:
        raise IsaUnavailable(
            f"{ENV_ISA}={isa}: this CPU (or compiler) has no {isa} path; -march=native "
            f"builds the {native.vec_path!r} path here (use auto)"
        )
    return native


def chosen_kernel(
    load: Callable[[str, str, str], NativeKernel | KernelBuildError], isa: str | None
) -> NativeKernel | None:
    """The kernel ``load`` (cached by compiler, cache folder and path) gives for ``isa``
    (default ``ZERO_OFFLOAD_ISA``), or None when disabled or unavailable
    (``ZERO_OFFLOAD_KERNELS=required`` raises the build's error instead)."""
    mode = kernel_mode()
    if mode == "off":
        return None
    got = load(" ".join(compiler()), str(cache_dir()), kernel_isa(isa))
    if isinstance(got, KernelBuildError):
        if mode == "required":
            raise type(got)(f"{ENV_MODE}=required but the kernel failed to build: {got}")
        return None
    return got


def run_in_parts(work: Callable[[int], None], parts: int) -> None:
    """``work(j)`` for every part j, each on a thread of its own but the first, which runs on
    the caller's: a kernel built without OpenMP is called on disjoint ranges, without the
    GIL."""
    workers = [threading.Thread(target=work, args=(j,)) for j in range(1, parts)]
    for w in workers:
        w.start()
    work(0)
    for w in workers:
        w.join()
