"""Stage 3's gathers on one rank cost no copy: the shard's memory (the host slice, or the
buffer an NVMe read filled) becomes the gathered parameters' storage until they are released,
with results bit for bit those of a stage that gathers nothing. The copies left in a
stage-3 step are counted in ``engine.last_step``, and looking up what to gather ahead takes
a few entries of the recorded order per module, not the whole order (which made a
backward O(units^2))."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo


class _Counting(list):
    """A list that counts the elements read from it (iterated or sliced)."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.read = 0

    def __iter__(self):
        for item in super().__iter__():
            self.read += 1
            yield item

    def __getitem__(self, key):
        got = super().__getitem__(key)
        self.read += len(got) if isinstance(key, slice) else 1
        return got


def test_gathering_ahead_reads_a_few_recorded_entries_per_module():
    units = 96
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(units)])
    engine = zo.initialize(model, stage=3, lr=1e-3, prefetch_depth=2)
    x = torch.randn(2, 4)
    engine.backward(engine(x).square().mean())
    engine.step()
    recorded = _Counting(engine._parts.gatherer.recorded)
    engine._parts.gatherer.recorded = recorded
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.close()
    assert len(recorded) == units
    # forward and backward each look at O(prefetch_depth) entries per unit gathered; a
    # scan of the order per unit reads ~units^2 / 2 = 4608 in each
    assert recorded.read <= 8 * units


def _train(tmp_path, stage: int, param: str, optim: str, steps: int = 2, **kw):
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(),
        stage=stage,
        lr=1e-2,
        offload_param=param,
        offload_optimizer=optim,
        nvme_path=tmp_path,
        dtype=torch.bfloat16,
        **kw,
    )
    gen = torch.Generator().manual_seed(0)
    stats = []
    for _ in range(steps):
        x, y = batch("gpt", 4, gen)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
        stats.append(dict(engine.last_step))
    return engine, stats


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_one_rank_gathers_without_copies(tmp_path, param, optim):
    engine, stats = _train(tmp_path, 3, param, optim)
    got = engine.full_state_dict()
    engine.close()
    for s in stats:
        assert s["gather_copy_bytes"] == 0
        assert s["gathered_shared_bytes"] > 0
    base, _ = _train(tmp_path, 2, "none", "none")
    want = base.full_state_dict()
    base.close()
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.parametrize("optim", ["none", "nvme"])
def test_one_rank_flattens_gradients_where_they_are_summed(tmp_path, optim):
    """Each gradient is copied once, out of ``param.grad`` into the gradient shard (the host
    shard of an offloaded optimizer): no flat buffer, no sum after it. A second backward
    before the step sums into it (and the host shard widens to fp32 for that)."""
    engine, stats = _train(tmp_path, 3, "nvme", optim)
    grad_bytes = sum(u.full_bytes for u in engine.units if not u.frozen)
    got = engine.full_state_dict()
    engine.close()
    for s in stats:
        assert s["grad_flatten_bytes"] == grad_bytes
        assert s["grad_add_bytes"] == 0
    base, _ = _train(tmp_path, 2, "none", "none")
    want = base.full_state_dict()
    base.close()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    engine, stats = _train(tmp_path, 3, "none", optim, gradient_accumulation_steps=2)
    assert stats[-1]["grad_flatten_bytes"] == 2 * grad_bytes
    assert stats[-1]["grad_add_bytes"] == grad_bytes * (2 if optim == "nvme" else 1)
    engine.close()
