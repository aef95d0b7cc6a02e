"""The training-quality campaign's code path at smoke size (the 300-step, 20M-parameter,
three-seed runs are ``zero-offload bench state-quality``; docs/optimizer_states.md has their
results): every precision learns, and 8-bit moments track fp32 AdamW."""

from __future__ import annotations

import json
import math
from pathlib import Path

from zero_offload.bench.training import state_quality


def test_smoke_run_learns_and_8bit_tracks_fp32(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    png = tmp_path / "q.png"
    code = state_quality.main(
        [
            "--tiny",
            "--steps",
            "40",
            "--seeds",
            "0",
            "--variants",
            "fp32",
            "8bit",
            "8bit+bf16_sr",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--threads",
            "1",
        ]
    )
    assert code == 0
    saved = json.loads(out.read_text())
    for name, by_seed in saved["runs"].items():
        assert by_seed["0"]["final_eval"] < 0.85 * math.log(128), name  # it learns
    summary = saved["summary"]
    assert abs(summary["8bit"]["vs_fp32_mean"] - 1) < 0.03
    assert abs(summary["8bit+bf16_sr"]["vs_fp32_mean"] - 1) < 0.05
    assert summary["8bit+bf16_sr"]["state_bytes"] < 0.4 * summary["fp32"]["state_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "q_vs_fp32.png").exists()
