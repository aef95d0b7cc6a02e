"""Child Python processes that tests signal and read line by line (preemption, cleanup)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

import zero_offload

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = Path(zero_offload.__file__).resolve().parent.parent  # the zero_offload under test


def start_python(code: str, *args: str) -> subprocess.Popen:
    """``python -c code args...`` in the repository root, its output read as text."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c code args...`` to its end (for cases that would crash the interpreter when
    they go wrong), with the zero_offload under test and tests/ on its path and one OpenMP
    thread; its output captured as text."""
    path = os.pathsep.join([str(PACKAGE_ROOT), str(REPO / "tests")])
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def next_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next line of output (it prints one when it is ready for the next move);
    the test fails, with the child's stderr, if none comes or the child ended."""
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], timeout)[0]:
        proc.kill()
        pytest.fail(f"child silent for {timeout} s: {proc.communicate()[1][-2000:]}")
    line = proc.stdout.readline().strip()
    if not line:
        pytest.fail(f"child ended early ({proc.wait(timeout)}): {proc.communicate()[1][-2000:]}")
    return line
