"""A regular (non-editable) install works like the source tree: the wheel carries every
subpackage and the C kernel sources, and the kernel builds on first use from the installed
copy instead of silently falling back to torch."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Runs against the installed copy only (cwd and sys.path hold no source tree).
CHECK = """
import sys, torch, zero_offload
from zero_offload.optim.native import adam_kernel as K
assert zero_offload.__file__.startswith(sys.argv[1]), zero_offload.__file__
k = K.get_kernel()  # ZERO_OFFLOAD_KERNELS=required: a missing source or failed build raises
assert k is not None
p, g = torch.randn(1000), torch.randn(1000)
m, v = torch.zeros(1000), torch.zeros(1000)
ref = [t.clone() for t in (p, m, v)]
K.adam_update(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
K.torch_update(*ref[:1], g, *ref[1:], step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.0, adamw=True, out=None)
torch.testing.assert_close(p, ref[0])
print("kernel:", K.kernel_status())
"""


def _build_isolation() -> list[str]:
    """Build with the installed setuptools when it can make wheels (no download); else let pip
    fetch the build requirements into an isolated environment."""
    if importlib.util.find_spec("setuptools") is None:
        return []
    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    can_wheel = (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None
    return ["--no-build-isolation"] if can_wheel else []


def _source_copy(dest: Path) -> Path:
    """What a clean checkout holds for the build (pip builds in the tree; keep ours clean)."""
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "zero_offload",
        dest / "zero_offload",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"),
    )
    shutil.copytree(ROOT / "kernels", dest / "kernels")
    return dest


@pytest.mark.large
def test_wheel_ships_the_kernel_sources_and_builds_them(tmp_path):
    src = _source_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        pip + ["wheel", "--no-deps", *_build_isolation(), "-w", str(wheels), str(src)],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = wheels.glob("zero_offload-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {
        str(p.parent.relative_to(ROOT)) for p in (ROOT / "zero_offload").rglob("__init__.py")
    }
    missing = [p for p in sorted(packages) if f"{p}/__init__.py" not in names]
    assert not missing, f"subpackages missing from the wheel: {missing}"
    kernels = sorted(p.name for p in (ROOT / "kernels").glob("*.c"))
    assert kernels and all(f"zero_offload/_kernels/{k}" in names for k in kernels), names

    site = tmp_path / "site"
    subprocess.run(
        pip + ["install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "ZERO_OFFLOAD_KERNELS": "required",
        "ZERO_OFFLOAD_CACHE": str(tmp_path / "cache"),
    }
    env.pop("ZERO_OFFLOAD_ISA", None)
    res = subprocess.run(
        [sys.executable, "-c", CHECK, str(site)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "kernel: native" in res.stdout
    assert list((tmp_path / "cache").glob("cpu_adam-*.so"))
