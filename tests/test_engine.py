"""Single-process engine behaviour: the step contract, float16 loss scaling, lr schedulers,
state dicts, and stage-3 gathering under a changing module order."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from support.models import MLP, TinyGPT, batch, loss_fn

import zero_offload as zo


def _step(engine, name, gen, n=4):
    x, y = batch(name, n, gen)
    loss = loss_fn(name, engine(x), y)
    engine.backward(loss)
    return engine.step()


def test_step_reports_accumulation_boundary():
    engine = zo.initialize(MLP(), stage=2, gradient_accumulation_steps=3)
    gen = torch.Generator().manual_seed(0)
    assert [_step(engine, "mlp", gen) for _ in range(6)] == [False, False, True] * 2
    assert engine.global_steps == 2


def test_float16_overflow_skips_the_step_and_lowers_the_scale(caplog):
    torch.manual_seed(0)
    model = MLP()
    engine = zo.initialize(model, stage=2, dtype=torch.float16, initial_loss_scale=2.0**40)
    before = engine.full_state_dict()
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING):
        applied = _step(engine, "mlp", gen)
    assert not applied and "overflow" in caplog.text
    assert engine.loss_scale == 2.0**39
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a sane scale trains and matches an fp16-compute / fp32-master reference closely
    engine = zo.initialize(MLP(), stage=2, dtype=torch.float16, initial_loss_scale=2.0**8)
    assert _step(engine, "mlp", gen)


def test_lr_scheduler_drives_the_engine():
    torch.manual_seed(0)
    engine = zo.initialize(MLP(), stage=1, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 0.0)
    before = engine.full_state_dict()
    gen = torch.Generator().manual_seed(0)
    _step(engine, "mlp", gen)
    sched.step()
    assert engine.param_groups[0]["lr"] == 0.0
    after = engine.full_state_dict()
    # lr 0: AdamW changes nothing (weight decay is scaled by lr too)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_state_dict_loads_into_the_original_model(stage):
    torch.manual_seed(0)
    model = TinyGPT()
    fresh = copy.deepcopy(model)
    engine = zo.initialize(model, stage=stage, lr=1e-2)
    _step(engine, "gpt", torch.Generator().manual_seed(0))
    sd = engine.full_state_dict()
    assert set(sd) == set(fresh.state_dict())
    assert sd["lm_head.weight"] is not None and torch.equal(sd["lm_head.weight"], sd["wte.weight"])
    fresh.load_state_dict(sd)
    assert all(v.dtype == torch.float32 for v in sd.values())


def test_backward_needs_a_scalar():
    engine = zo.initialize(MLP(), stage=2)
    out = engine(torch.randn(2, 16))
    with pytest.raises(ValueError, match="scalar"):
        engine.backward(out)


def test_initialize_needs_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zo.initialize(lambda x: x)


class Router(nn.Module):
    """Module order depends on the input: a data-dependent branch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        first, second = (self.a, self.b) if x.sum() > 0 else (self.b, self.a)
        return self.out(torch.tanh(second(torch.tanh(first(h)))))


@pytest.mark.parametrize("offload_param", ["none", "nvme"])
def test_changed_module_order_warns_and_stays_correct(caplog, tmp_path, offload_param):
    torch.manual_seed(0)
    model = Router()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = zo.initialize(
        model, stage=3, lr=1e-2, prefetch_depth=2, offload_param=offload_param, nvme_path=tmp_path
    )
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING):
        for i in range(6):
            x, y = batch("mlp", 4, gen)
            x = x.abs() if i % 2 == 0 else -x.abs()
            engine.backward(loss_fn("mlp", engine(x), y))
            engine.step()
            loss_fn("mlp", ref(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert "different order" in caplog.text
    assert engine._parts.gatherer.order_changes >= 1
    sd = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=3e-4)
    engine.close()


def test_stage3_module_called_outside_the_engine_gathers_without_a_warning(caplog):
    """An inference loop on ``engine.module`` (e.g. Hugging Face ``generate``) runs outside
    ``engine(...)``: parameters are gathered and freed, and the recorded order is untouched."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    engine = zo.initialize(model, stage=3, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    _step(engine, "gpt", gen)
    recorded = list(engine._parts.gatherer.recorded)
    x, _ = batch("gpt", 2, gen)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        out = engine.module(x[:, :3])
        engine.module(x[:, :5])
    assert not [r for r in caplog.records if "different order" in r.message]
    assert (
        engine._parts.gatherer.recorded == recorded and engine._parts.gatherer.gathered_bytes == 0
    )
    reference.load_state_dict(engine.full_state_dict())
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x[:, :3]))
