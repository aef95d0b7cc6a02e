"""Child Python processes that tests signal and read line by line (preemption, cleanup)."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def start_python(code: str, *args: str) -> subprocess.Popen:
    """``python -c code args...`` in the repository root, its output read as text."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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
