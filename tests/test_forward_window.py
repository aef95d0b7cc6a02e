"""``model(x)`` and ``engine(x)`` are the same call (the root module's hooks open the engine's
forward window), a forward that raises or is interrupted leaves nothing open, and a trainer's
explicit window around a step function joins the forwards inside it."""

from __future__ import annotations

import pytest
import torch
from support.models import batch, loss_fn, make

import zero_offload as zo

GEN_SEED = 3


def _train(call, stage: int, steps: int = 3, interrupt_at: int | None = None) -> list[float]:
    torch.manual_seed(0)
    model = make("gpt")
    engine = zo.initialize(model, stage=stage, lr=1e-2)
    gen = torch.Generator().manual_seed(GEN_SEED)
    losses = []
    for i in range(steps):
        x, y = batch("gpt", 4, gen)
        if i == interrupt_at:
            stop = model.blocks[1].register_forward_pre_hook(_raise_interrupt)
            with pytest.raises(KeyboardInterrupt):
                call(engine, model, x)
            stop.remove()
            assert engine._window.is_open  # torch skipped the post-forward hooks
            engine.zero_grad()  # closes the window the interrupt left open
            assert not engine._window.is_open
        loss = loss_fn("gpt", call(engine, model, x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def _raise_interrupt(*_):
    raise KeyboardInterrupt


def _engine_call(engine, model, x):
    return engine(x)


def _model_call(engine, model, x):
    return model(x)


@pytest.mark.parametrize("stage", [0, 3])
def test_calling_the_model_is_calling_the_engine(stage):
    assert _train(_model_call, stage) == _train(_engine_call, stage)


def test_an_interrupted_forward_leaves_no_window_open(stage=3):
    """KeyboardInterrupt skips torch's post-forward hooks: the engine's next call ends the
    forward it left, and training goes on exactly as without the interruption."""
    assert _train(_model_call, stage, interrupt_at=1) == _train(_model_call, stage)


def test_a_forward_that_raises_closes_its_window():
    torch.manual_seed(0)
    model = make("gpt")
    engine = zo.initialize(model, stage=3, lr=1e-2)
    bad = model.blocks[0].register_forward_pre_hook(lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(torch.zeros(2, 8, dtype=torch.long))
    assert not engine._window.is_open
    bad.remove()
    x, y = batch("gpt", 4, torch.Generator().manual_seed(GEN_SEED))
    engine.backward(loss_fn("gpt", model(x), y))
    assert engine.step()
    engine.close()


def test_an_explicit_window_joins_the_forwards_inside_it():
    """A trainer's step function that calls submodules (not the root) still runs in one
    window: stage 3 gathers what each block needs and the loss matches the engine call."""
    torch.manual_seed(0)
    model = make("gpt")
    engine = zo.initialize(model, stage=3, lr=1e-2)
    x, y = batch("gpt", 4, torch.Generator().manual_seed(GEN_SEED))
    with engine.forward_window():
        assert engine._window.is_open
        inside = loss_fn("gpt", model(x), y)  # joins: the window stays open after it
        assert engine._window.is_open
    assert not engine._window.is_open
    with torch.no_grad():
        assert loss_fn("gpt", engine(x), y).item() == inside.item()
    engine.close()
