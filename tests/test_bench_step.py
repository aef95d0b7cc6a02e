"""``bench step`` at tiny size: it runs every optimizer tier, reports sane numbers as JSON,
sweeps prefetch depth against the resident stage-3 run, and refuses a memory filesystem."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from zero_offload.bench.training import step

TINY = [
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--sub-group-size",
    "4096",
    "--baseline-size",
    "1MiB",
    "--json",
]
SAMPLE_KEYS = {
    "fwd_s",
    "bwd_s",
    "fwd_bwd_s",
    "step_s",
    "total_s",
    "opt_read_s",
    "opt_write_s",
    "opt_io_busy_s",
    "opt_compute_s",
    "opt_wall_s",
    "bytes_read",
    "bytes_written",
    "overlap",
}


def _bench(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict]:
    rc = step.main(list(argv))
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def test_every_optimizer_tier(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rss_before = psutil.Process().memory_info().rss
    rc, rep = _bench(
        capsys, *TINY, "--offload-optimizer", "none", "cpu", "nvme", "--nvme-path", str(tmp_path)
    )
    rss_after = psutil.Process().memory_info().rss
    # a floor the process's RSS cannot have left during the bench: memory freed in it (an
    # earlier test's garbage collected, an arena trimmed) lowers the RSS after it, not before
    rss_floor = min(rss_before, rss_after)
    assert rc == 0
    assert rep["model"]["params"] > 0 and rep["steps"] == 2 and rep["sweep"] is None
    assert rep["baseline"]["read_gbps"] > 0 and rep["baseline"]["write_gbps"] > 0
    runs = {r["offload_optimizer"]: r for r in rep["runs"]}
    assert set(runs) == {"none", "cpu", "nvme"}
    for name, r in runs.items():
        assert r["error"] is None, r["error"]
        assert len(r["samples"]) == 2
        med = r["median"]
        assert set(med) == SAMPLE_KEYS
        for key in ("fwd_bwd_s", "step_s", "total_s", "opt_compute_s", "opt_wall_s"):
            assert med[key] > 0, (name, key)
        assert med["total_s"] >= med["step_s"]
        for s in r["samples"]:  # the phases add up, each step's peak RSS is read
            assert s["fwd_s"] > 0 and s["bwd_s"] > 0
            assert s["fwd_s"] + s["bwd_s"] == pytest.approx(s["fwd_bwd_s"])
            assert s["fwd_bwd_s"] + s["step_s"] == pytest.approx(s["total_s"])
            assert 0 < s["peak_rss"] <= r["peak_rss"]
        assert r["peak_rss"] >= 0.9 * rss_floor  # the process's RSS, not a difference
        assert 0 < med["overlap"] <= 1.05, (name, med["overlap"])
    nvme = runs["nvme"]["median"]
    assert nvme["opt_read_s"] > 0 and nvme["opt_write_s"] > 0
    # fp32 master + m + v of every parameter read and written once per step
    assert nvme["bytes_read"] == nvme["bytes_written"] >= 12 * rep["model"]["params"]
    assert runs["nvme"]["nvme_gbps"] > 0 and runs["nvme"]["io_efficiency"] > 0
    assert runs["cpu"]["median"]["bytes_read"] == 0 and runs["cpu"]["nvme_gbps"] is None
    assert list(tmp_path.iterdir()) == [], "swap and baseline files must be removed"


def test_prefetch_depth_sweep_against_resident(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    rc, rep = _bench(
        capsys,
        *TINY,
        "--offload-optimizer",
        "cpu",
        "--offload-param",
        "cpu",
        "--prefetch-depth",
        "0",
        "1",
        "--nvme-path",
        str(tmp_path),
    )
    assert rc == 0
    runs = {(r["offload_param"], r["prefetch_depth"]): r for r in rep["runs"]}
    assert set(runs) == {("cpu", 0), ("cpu", 1), ("none", step.REFERENCE_DEPTH)}
    assert runs[("none", step.REFERENCE_DEPTH)]["error"] is None
    offloaded = [r for r in rep["runs"] if r["offload_param"] == "cpu"]
    if any(r["error"] and r["error"].startswith("not implemented") for r in offloaded):
        pytest.skip(f"offload_param='cpu' not available yet: {offloaded[0]['error']}")
    assert [row["prefetch_depth"] for row in rep["sweep"]] == [0, 1]
    for row in rep["sweep"]:
        assert row["error"] is None and row["total_s"] > 0 and row["ratio_to_resident"] > 0


def test_depth_sweep_rows_say_their_overlap_and_compare_with_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """With --overlap-step both each depth runs twice: each row says which, and is divided by
    the resident run with the same overlap_step."""
    rc, rep = _bench(
        capsys,
        *TINY,
        "--offload-optimizer",
        "nvme",
        "--offload-param",
        "nvme",
        "--prefetch-depth",
        "0",
        "1",
        "--overlap-step",
        "both",
        "--nvme-path",
        str(tmp_path),
    )
    assert rc == 0
    resident = {
        r["overlap_step"]: r["median"]["total_s"]
        for r in rep["runs"]
        if r["offload_param"] == "none"
    }
    assert set(resident) == {False, True}
    rows = {(row["prefetch_depth"], row["overlap_step"]): row for row in rep["sweep"]}
    assert set(rows) == {(d, o) for d in (0, 1) for o in (False, True)}
    for (_, overlap), row in rows.items():
        assert row["ratio_to_resident"] == pytest.approx(row["total_s"] / resident[overlap])


def test_refuses_missing_or_memory_nvme_path(
    tiny_tmpfs: Path, capsys: pytest.CaptureFixture
) -> None:
    assert step.main(["--preset", "tiny", "--offload-optimizer", "nvme"]) == 2
    assert "--nvme-path" in capsys.readouterr().err
    assert (
        step.main(
            ["--preset", "tiny", "--offload-optimizer", "nvme", "--nvme-path", str(tiny_tmpfs)]
        )
        == 2
    )
    assert "lives in memory" in capsys.readouterr().err


def test_model_config_follows_params() -> None:
    parser = step.argparse.ArgumentParser()
    step.add_arguments(parser)
    for target in (2e7, 3e8, 1.3e9):
        cfg = step.model_config(parser.parse_args(["--params", str(target)]))
        assert 0.8 * target < cfg.num_params < 1.25 * target
        assert cfg.width % 128 == 0 and cfg.width % cfg.heads == 0


def test_cli_wiring() -> None:
    from zero_offload import cli

    args = cli.build_parser().parse_args(["bench", "step", "--preset", "tiny", "--json"])
    assert args._module == "zero_offload.bench.training.step" and args.json


def test_optimizer_fraction_sweep_reports_disk_bytes_per_point(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--optimizer-fraction 0,0.5,1 with two interleaved rounds: each point keeps the samples
    of both rounds, the disk bytes of the optimizer step follow the share on NVMe, and the
    table compares each point with all on NVMe."""
    rc, rep = _bench(
        capsys,
        *TINY,
        "--offload-optimizer",
        "nvme",
        "--optimizer-fraction",
        "0,0.5,1",
        "--rounds",
        "2",
        "--nvme-path",
        str(tmp_path),
    )
    assert rc == 0 and rep["rounds"] == 2
    assert [r["optimizer_fraction"] for r in rep["runs"]] == [0.0, 0.5, 1.0]
    assert all(len(r["samples"]) == 4 and r["error"] is None for r in rep["runs"])
    rows = {row["optimizer_fraction"]: row for row in rep["fraction_sweep"]}
    assert rows[0.0]["disk_bytes"] == 0 < rows[0.5]["disk_bytes"] < rows[1.0]["disk_bytes"]
    assert rows[1.0]["disk_vs_all_nvme"] == 1.0 and rows[1.0]["time_vs_all_nvme"] == 1.0
    assert 0.3 < rows[0.5]["disk_vs_all_nvme"] < 0.7


def test_optimizer_fraction_needs_the_optimizer_on_nvme(capsys: pytest.CaptureFixture) -> None:
    assert step.main([*TINY, "--offload-optimizer", "cpu", "--optimizer-fraction", "0.5"]) == 2
    assert "--offload-optimizer nvme" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step.main([*TINY, "--optimizer-fraction", "0.5,2"])
