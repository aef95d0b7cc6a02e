"""``bench adam`` runs every variant interleaved and reports bytes, GB/s and paired ratios,
the optimizer-state variants against our fp32 kernel (tiny sizes: this checks the report,
not speed)."""

from __future__ import annotations

import json

import pytest

from zero_offload.bench.micro import adam


def test_state_variants_report_bytes_and_ratios(capsys: pytest.CaptureFixture) -> None:
    code = adam.main(
        [
            "--params",
            "20000",
            "--rounds",
            "2",
            "--threads",
            "1",
            "--json",
            "--states",
            "adamw 8-bit,lion 8-bit,adamw 8-bit + bf16_sr master",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["path"], r["variant"]): r for r in out["results"]}
    eight = rows[("fp32", "zero_offload adamw 8-bit")]
    assert eight["bytes_per_param"] == pytest.approx(2 * (4 + 2 * (1 + 4 / 256)) + 4)
    assert eight["baseline"] == "zero_offload CPUAdam" and eight["ratio"] > 0
    assert set(eight["targets"]) == {"x our fp32"}  # torchao / bitsandbytes only with 'all'
    sr = rows[("bf16", "zero_offload adamw 8-bit + bf16_sr master")]
    assert sr["bytes_per_param"] == pytest.approx(2 * (2 + 2 * (1 + 4 / 256)) + 2 + 2)
    assert sr["baseline"] == "zero_offload CPUAdam, fused out"
    assert all(len(r["seconds"]) == 3 for r in out["results"])  # min / median / max


def test_unknown_state_label_is_refused(capsys: pytest.CaptureFixture) -> None:
    assert adam.main(["--params", "1000", "--states", "adamw 4-bit"]) == 2
    assert "adamw 4-bit" in capsys.readouterr().err


def test_progress_in_a_log_is_one_line_per_variant(capsys: pytest.CaptureFixture) -> None:
    """Piped to a file (``2>&1 | tee bench.log``), the progress must read as lines, not one
    long line of carriage returns and padding."""
    assert (
        adam.main(["--params", "2000", "--rounds", "2", "--threads", "1", "--states", "none"]) == 0
    )
    err = capsys.readouterr().err
    assert "\r" not in err and "\033" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("round ")]
    assert lines[0] == "round 1/2: mem ceiling: read 4 / write 3 fp32 (C)"
    assert sum(ln.startswith("round 2/2: ") for ln in lines) == len(lines) // 2 > 0
    assert all(ln == ln.rstrip() for ln in lines)
