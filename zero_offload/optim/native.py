"""Compile the C kernels in ``kernels/`` on first use and load them with ctypes.

Why: the kernels are built for the exact CPU they run on (``-march=native``), so they cannot
ship prebuilt. A build is cached per user under a name keyed by the source, the flags, the
compiler version and the CPU, so a changed source, compiler or machine (a shared home on a
different node) gets its own library; builds are atomic so several ranks starting at once
are safe.

Environment:
    ``CC``: the C compiler (default ``cc``).
    ``ZERO_OFFLOAD_CACHE``: the cache folder (default ``~/.cache/zero_offload``).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from ..errors import KernelBuildError

logger = logging.getLogger(__name__)

BASE_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300


def kernels_dir() -> Path:
    """Where the C sources live: ``kernels/`` beside the package in a source tree (a checkout
    on ``sys.path`` or installed in editable mode), else the data package
    ``zero_offload._kernels`` that the wheel ships them as."""
    source = Path(__file__).resolve().parents[2] / "kernels"
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
        import platform

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
