"""The trainer integrations are optional: importing zero_offload (and using its engine, its
DeepSpeed config translation and its CLI) imports neither transformers nor lightning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_zero_offload_imports_no_trainer_library():
    code = (
        "import sys, torch, zero_offload as zo\n"
        "zo.initialize(torch.nn.Linear(2, 2), config={'zero_optimization': {'stage': 2}})\n"
        "import zero_offload.cli, zero_offload.cli.convert\n"
        "bad = [m for m in ('transformers', 'lightning', 'accelerate', 'trl') if m in "
        "sys.modules]\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
