"""What a run shows: ``engine.last_step`` after each update, and the profiler ranges a user's
``torch.profiler`` trace gets (forward, backward, step, gathers, reductions, swap I/O, CPU
Adam)."""

from __future__ import annotations

import pytest
import torch
from support.models import batch, loss_fn, make
from torch.profiler import profile

import zero_offload as zo


def _train_step(engine, gen, micro: int = 1) -> None:
    for _ in range(micro):
        x, y = batch("gpt", 4, gen)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()


@pytest.mark.parametrize("overlap", [False, True])
def test_last_step_and_profiler_ranges_stage3_nvme(tmp_path, overlap):
    torch.manual_seed(0)
    engine = zo.initialize(
        make("gpt"),
        stage=3,
        offload_optimizer="nvme",
        offload_param="nvme",
        nvme_path=str(tmp_path),
        max_grad_norm=1.0,
        gradient_accumulation_steps=2,
        overlap_step=overlap,
    )
    gen = torch.Generator().manual_seed(0)
    _train_step(engine, gen, micro=2)  # the first step records the module order
    with profile() as prof:
        _train_step(engine, gen, micro=2)
        engine.finish_step()  # with overlap_step, the update runs on until the next forward
    names = {e.name for e in prof.events()}
    for phase in (
        "forward",
        "backward",
        "step",
        "gather",
        "reduce_scatter",
        "cpu_adam",
        "swap_in",
        "swap_out",
    ):
        assert f"zero_offload.{phase}" in names, phase
    s = engine.last_step
    assert s["applied"] == 1.0 and s["skipped_steps"] == 0.0 and s["loss_scale"] == 1.0
    assert s["grad_norm"] == engine.last_grad_norm > 0
    # two micro-batches of forward and backward are in one step's numbers
    assert s["forward_s"] > 0 and s["backward_s"] > 0
    if not overlap:  # else the update ran on after step() returned
        assert s["step_s"] >= s["optimizer_wall_s"]
    assert s["optimizer_wall_s"] >= s["adam_s"] > 0
    assert s["nvme_read_s"] > 0 and s["nvme_write_s"] > 0 and s["disk_gbps"] > 0
    assert s["peak_gathered_bytes"] == engine.memory_report().peak_gathered_param_bytes
    comm = engine.memory_report().comm
    assert s["all_gather_calls"] == comm["all_gather"].calls > 0
    assert s["reduce_scatter_bytes"] == comm["reduce_scatter"].bytes
    engine.close()


def test_last_step_stage1_without_offload_has_no_disk_numbers():
    torch.manual_seed(0)
    engine = zo.initialize(make("gpt"), stage=1)
    gen = torch.Generator().manual_seed(0)
    with profile() as prof:
        _train_step(engine, gen)
    assert "zero_offload.reduce" in {e.name for e in prof.events()}
    s = engine.last_step
    assert "nvme_read_s" not in s and "grad_norm" not in s  # no clipping: no norm computed
    assert s["applied"] == 1.0 and s["step_s"] > 0
