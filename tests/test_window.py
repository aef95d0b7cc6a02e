"""The window coordinator (``update/window.py``): the transition table itself, and the
phases and update windows real engines pass through (stages 2 and 3, ``overlap_step`` on
and off, the NVMe optimizer stepping during backward)."""

from __future__ import annotations

import pytest
import torch
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.update.window import (
    ENTERED_FROM,
    UPDATE_MOVES,
    Phase,
    UpdateWindow,
    WindowCoordinator,
)

F, B, R, S, IDLE, L = (
    Phase.FORWARD,
    Phase.BACKWARD,
    Phase.REDUCED,
    Phase.STEP,
    Phase.IDLE,
    Phase.LENDING,
)
EARLY, AT_STEP, UNDER = UpdateWindow.EARLY, UpdateWindow.AT_STEP, UpdateWindow.UNDER_FORWARD


# -- the table -----------------------------------------------------------------------------
def test_the_table_names_every_active_phase_and_no_resting_one():
    assert set(ENTERED_FROM) == {F, B, S, L}
    assert IDLE not in ENTERED_FROM and R not in ENTERED_FROM


def test_a_backward_inside_a_backward_or_a_step_inside_one_is_refused():
    w = WindowCoordinator()
    w.enter(B)
    for phase in (B, S, L):
        with pytest.raises(RuntimeError, match="internal error.*entered from BACKWARD"):
            w.enter(phase)
    with pytest.raises(RuntimeError, match="internal error"):
        w.cleared()  # gradients dropped mid-backward
    w.leave(B)
    assert w.phase is R  # a backward leaves gradients
    with pytest.raises(RuntimeError, match="left while in REDUCED"):
        w.leave(B)
    w.enter(S)
    with pytest.raises(RuntimeError, match="entered from STEP"):
        w.enter(F)


def test_phases_nest_and_leaving_returns_to_the_one_below():
    w = WindowCoordinator()
    with w.during(F):  # a trainer's step function: backward and step inside its window
        w.enter(B)
        w.leave(B)
        assert w.phase is F
        with w.during(S):
            w.cleared()
        assert w.boundaries == 1
    assert w.phase is IDLE
    with w.during(L):
        assert w.lending
        with w.during(L):
            pass
        assert w.lending
    assert not w.lending


def test_update_moves_follow_the_table():
    assert (UNDER, EARLY) not in UPDATE_MOVES and (AT_STEP, UNDER) not in UPDATE_MOVES
    w = WindowCoordinator()
    with pytest.raises(RuntimeError, match="moved from none to AT_STEP in phase IDLE"):
        w.begin_update(AT_STEP)  # only inside step()
    w.enter(S)
    assert w.begin_update(AT_STEP) is None
    with pytest.raises(RuntimeError, match="moved from AT_STEP to UNDER_FORWARD"):
        w.begin_update(UNDER)
    w.end_update()
    assert w.update is None


# -- real engines --------------------------------------------------------------------------
def _engine(tmp_path, stage: int, nvme: bool = False, **kw) -> zo.Engine:
    torch.manual_seed(0)
    extra = (
        dict(
            offload_optimizer="nvme",
            offload_param="nvme" if stage == 3 else "none",
            nvme_path=str(tmp_path),
            sub_group_size=1024,
        )
        if nvme
        else {}
    )
    return zo.initialize(
        TinyGPT(layers=2, width=32), stage=stage, dtype=torch.bfloat16, lr=1e-2, **extra, **kw
    )


def _observed(engine: zo.Engine, steps: int = 2, accumulate: int = 1) -> list[tuple]:
    """The (phase, update window) changes of a plain loop, consecutive repeats merged."""
    seen: list[tuple] = []

    def note(phase: Phase, update: UpdateWindow | None) -> None:
        if not seen or seen[-1] != (phase, update):
            seen.append((phase, update))

    engine._parts.coordinator.watch(note)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = batch("gpt", 4, gen)
            engine.backward(loss_fn("gpt", engine(x), y))
            engine.step()
    engine.finish_step()
    engine.close()
    return seen


@pytest.mark.parametrize("stage", [2, 3])
def test_a_step_in_memory_updates_at_step(tmp_path, stage):
    seen = _observed(_engine(tmp_path, stage))
    one = [(F, None), (IDLE, None), (B, None), (R, None), (S, None), (S, AT_STEP), (S, None)]
    one += [(IDLE, None)]
    assert seen == one + one


def test_accumulation_steps_between_boundaries_keep_the_gradients(tmp_path):
    seen = _observed(_engine(tmp_path, 2, gradient_accumulation_steps=2), steps=1, accumulate=2)
    assert seen == [
        (F, None),
        (IDLE, None),
        (B, None),
        (R, None),
        (S, None),
        (R, None),  # between boundaries: nothing applied, the gradients stay
        (F, None),
        (R, None),
        (B, None),
        (R, None),
        (S, None),
        (S, AT_STEP),
        (S, None),
        (IDLE, None),
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_stage3_nvme_runs_the_update_at_step_or_under_the_next_forward(tmp_path, overlap):
    engine = _engine(tmp_path, 3, nvme=True, overlap_step=overlap, step_during_backward=False)
    seen = _observed(engine, steps=3)
    updates = [u for _, u in seen if u is not None]
    if not overlap:
        assert set(updates) == {AT_STEP}
        return
    assert set(updates) == {UNDER}
    # left pending by step(), finished by the next forward (or the engine call after it)
    assert (IDLE, UNDER) in seen and (F, UNDER) in seen
    assert seen[-1] == (IDLE, None)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_final_backward_steps_early_and_the_step_adopts_it(tmp_path, stage):
    engine = _engine(tmp_path, stage, nvme=True, step_during_backward=True, overlap_step=False)
    seen = _observed(engine)
    assert (B, EARLY) in seen
    early = seen.index((B, EARLY))
    # the pass runs on past the backward until step() adopts it into its own window
    assert seen[early + 1 : early + 4] == [(R, EARLY), (S, EARLY), (S, AT_STEP)]


def test_zero_grad_drops_the_early_pass_and_the_gradients(tmp_path):
    engine = _engine(tmp_path, 2, nvme=True, step_during_backward=True)
    x, y = batch("gpt", 4, torch.Generator().manual_seed(1))
    engine.backward(loss_fn("gpt", engine(x), y))
    assert (engine._parts.coordinator.phase, engine._parts.coordinator.update) == (R, EARLY)
    engine.zero_grad()
    assert (engine._parts.coordinator.phase, engine._parts.coordinator.update) == (IDLE, None)
    assert engine._parts.coordinator.early is None
    engine.close()


def test_gathered_parameters_lends_and_forwards_inside_open_no_window(tmp_path):
    engine = _engine(tmp_path, 3)
    x, _ = batch("gpt", 4, torch.Generator().manual_seed(1))
    seen: list[Phase] = []
    engine._parts.coordinator.watch(lambda phase, _update: seen.append(phase))
    with engine.gathered_parameters(), torch.no_grad():
        engine.module(x)
    assert seen == [L, IDLE]
    engine.close()
