"""The CPU Adam writes a step's new compute-dtype parameters straight into where stage 3
stores them (the host shard, or the buffer a shard is written to disk from): no host copy of
parameter values after the update, counted by ``last_step_timings.param_copy_bytes``, and
the same parameters as stage 3 without offload, bit for bit."""

from __future__ import annotations

import pytest
import torch
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo


def _train(tmp_path, param: str, optim: str, dtype: torch.dtype) -> tuple[zo.Engine, list[int]]:
    torch.manual_seed(0)
    # small sub-groups: units are cut by their bounds
    engine = zo.initialize(
        TinyGPT(),
        stage=3,
        offload_param=param,
        offload_optimizer=optim,
        nvme_path=tmp_path,
        sub_group_size=3000,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(0)
    copied = []
    for _ in range(2):
        x, y = batch("gpt", 4, gen)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
        copied.append(engine.last_step_timings.param_copy_bytes)
    return engine, copied


@pytest.mark.parametrize("param,optim", [("nvme", "nvme"), ("cpu", "nvme"), ("cpu", "cpu")])
def test_new_params_are_written_in_place(tmp_path, param, optim):
    engine, copied = _train(tmp_path, param, optim, torch.bfloat16)
    got = engine.full_state_dict()
    engine.close()
    assert copied == [0, 0]
    base, _ = _train(tmp_path, "none", "none", torch.bfloat16)
    want = base.full_state_dict()
    base.close()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_copies_are_counted_where_values_change_dtype(tmp_path):
    """In fp32 the new parameters are the master itself, kept in the optimizer's files:
    each shard is copied at least once on its way to its own file (the counter counts real
    copies)."""
    engine, copied = _train(tmp_path, "nvme", "nvme", torch.float32)
    shard_bytes = 4 * sum(u.shard_numel for u in engine.units if not u.frozen)
    engine.close()
    assert copied[0] == copied[1] >= shard_bytes
