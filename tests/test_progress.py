"""Long operations show how far they are: a tqdm bar when stderr is a terminal (and tqdm is
installed), else a log line at each tenth of the work. Checked on the progress class itself
and on the engine's long operations: materializing a model, loading weights, gathering the
full model (what ``save_model`` writes), saving, loading and consolidating a checkpoint."""

from __future__ import annotations

import io
import logging
import re
import sys

import torch
import torch.nn as nn

import zero_offload as zo
from zero_offload.progress import Progress, clear_status, show_status


def _percents(caplog, what: str) -> list[int]:
    return [
        int(m.group(1))
        for r in caplog.records
        if (m := re.search(re.escape(what) + r".*: (\d+)% \(", r.getMessage()))
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_benchmark_status_updates_one_terminal_line_and_writes_lines_to_a_log(monkeypatch):
    terminal, log = _Terminal(), io.StringIO()
    for stream in (terminal, log):
        monkeypatch.setattr(sys, "stderr", stream)
        show_status("round 1/2: fp32")
        show_status("round 2/2: fp32")
        clear_status()
    assert terminal.getvalue() == "\r\033[Kround 1/2: fp32\r\033[Kround 2/2: fp32\r\033[K"
    assert log.getvalue() == "round 1/2: fp32\nround 2/2: fp32\n"


def test_a_log_line_at_each_tenth(caplog):
    caplog.set_level(logging.INFO, logger="zero_offload")
    with Progress("copying", 1000, "parameters") as progress:
        for n in (50, 60, 240, 1, 349, 300):  # uneven steps; one line for a jump of tenths
            progress.update(n)
    assert _percents(caplog, "copying") == [10, 30, 70, 100]
    assert "copying: 100% (1000 of 1000 parameters)" in caplog.text


def test_nothing_on_other_ranks_and_for_no_work(caplog):
    caplog.set_level(logging.INFO, logger="zero_offload")
    with Progress("copying", 10, show=False) as progress:
        progress.update(10)
    with Progress("nothing", 0) as progress:
        progress.update(0)
    assert not caplog.records


def test_a_bar_on_a_terminal_and_log_lines_without_tqdm(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="zero_offload")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Progress("copying", 4 << 20, "B") as progress:
        progress.update(4 << 20)
    assert not caplog.records and "copying" in terminal.getvalue()  # tqdm drew it
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # tqdm not installed
    with Progress("copying", 4 << 20, "B") as progress:
        progress.update(4 << 20)
    assert "copying: 100% (4.0 MB of 4.0 MB)" in caplog.text


def test_engine_operations_report_progress(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="zero_offload")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(10)))  # ten equal units
    engine = zo.initialize(model, stage=3, offload_optimizer="cpu", lr=1e-2)
    assert _percents(caplog, "materializing the model") == list(range(10, 101, 10))
    engine.backward(engine(torch.randn(4, 16)).square().mean())
    engine.step()
    engine.full_state_dict()
    assert _percents(caplog, "gathering the full model")[-1] == 100
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.load_checkpoint(tmp_path / "ckpt")
    assert _percents(caplog, "saving checkpoint")[-1] == 100
    assert _percents(caplog, "loading checkpoint")[-1] == 100
    state = zo.consolidate_checkpoint(tmp_path / "ckpt", out=tmp_path / "model.safetensors")
    assert _percents(caplog, "consolidating checkpoint")[-1] == 100
    engine.close()

    caplog.clear()
    engine = zo.initialize(
        nn.Sequential(*(nn.Linear(16, 16) for _ in range(10))),
        stage=3,
        init_weights=tmp_path / "model.safetensors",
    )
    assert _percents(caplog, "loading weights from")[-1] == 100
    got = engine.full_state_dict()
    engine.close()
    assert all(torch.equal(got[k], state[k]) for k in got)
