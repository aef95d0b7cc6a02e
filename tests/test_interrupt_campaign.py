"""The interrupt campaign (``python -m zero_offload.bench.interrupts``) at a size CI affords:
a SIGINT and a SIGTERM at seeded random moments of an NVMe stage-3 run, each saved and resumed
in a new process bit for bit, and one disk filled up at a random moment (where a tmpfs can be
mounted). The full campaign (30 deliveries at world 1 and 2, 20 disk faults) is run by hand;
docs/preemption.md has its counts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.children import REPO


def _campaign(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zero_offload.bench.interrupts", "--workdir", str(tmp_path)]
        + list(args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.mark.large
@pytest.mark.multiprocess
def test_signals_at_random_moments_resume_bit_for_bit(tmp_path):
    res = _campaign(tmp_path, "--deliveries", "2", "--disk-faults", "0", "--steps", "6")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "w1-SIGINT-loop: 1 of 1 resumed bit for bit" in res.stdout
    assert "w1-SIGTERM-keyword: 1 of 1 resumed bit for bit" in res.stdout


@pytest.mark.large
@pytest.mark.multiprocess
def test_a_disk_filled_at_a_random_moment_fails_clearly_and_resumes(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    subprocess.run(["umount", "-l", str(probe)], check=False)
    res = _campaign(tmp_path, "--deliveries", "0", "--disk-faults", "1", "--steps", "6")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "w1-disk-full: 1 of 1 resumed bit for bit" in res.stdout
