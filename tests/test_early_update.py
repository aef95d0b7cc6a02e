"""Stepping NVMe sub-groups during the final backward (``max_grad_norm=None``): the results
are those of the step that runs after backward, bit for bit, in the loops users write — and
nothing a forward, an evaluation or a checkpoint reads changes before ``step()``.

The reference is the same engine with ``step_during_backward=False``. How many sub-groups
the pass finishes before ``step()`` depends on timing; the tests that need it to finish
every ready one make ``step()`` wait for it first."""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from support.distributed import run_ranks
from support.equivalence import assert_bit_equal, training_state
from support.models import TinyGPT, batch, loss_fn
from support.swap_faults import FaultBackend

import zero_offload as zo
from zero_offload.swap.folder import FILES
from zero_offload.update.nvme.early import EarlyUpdate

STEPS = 3


@pytest.fixture
def waits(monkeypatch):
    """``step()`` adopts every sub-group ready by then: the pass is waited for first."""
    check = EarlyUpdate.check

    def waited(self, *args):
        self.wait_idle()
        return check(self, *args)

    monkeypatch.setattr(EarlyUpdate, "check", waited)


def _engine(tmp_path, early: bool, dtype=torch.bfloat16, stage: int = 3, **kw) -> zo.Engine:
    torch.manual_seed(0)
    return zo.initialize(
        TinyGPT(layers=3, width=32),
        stage=stage,
        offload_optimizer="nvme",
        offload_param="nvme" if stage == 3 else "none",
        nvme_path=str(tmp_path),
        dtype=dtype,
        lr=1e-2,
        sub_group_size=1024,  # several sub-groups, some straddling units
        step_during_backward=early,
        **kw,
    )


def _train(engine: zo.Engine, what: str, rank: int = 0, world: int = 1) -> tuple[list, list]:
    """A few steps of a loop with something between backward and step (``what``); the
    losses, and how many sub-groups each step adopted from the pass (None: no update)."""
    gen = torch.Generator().manual_seed(1)
    losses, early, states = [], [], []
    for step in range(STEPS):
        x, y = batch("gpt", 4 * world, gen)
        x, y = x[rank::world], y[rank::world]
        loss = loss_fn("gpt", engine(x), y)
        engine.backward(loss)
        if what == "twice" and step == 1:  # two backwards before one step: their sum
            engine.backward(loss_fn("gpt", engine(x.flip(0)), y.flip(0)))
        if what == "scaled" and step == 1:  # clipped by hand: the step reads the new sums
            engine.grads.mul_(0.5)
        if what == "lr" and step == 1:  # changed after backward: this step uses it
            engine.optimizer.param_groups[0]["lr"] = 3e-3
        if what == "eval" and step == 1:  # the parameters are the old ones until step()
            with torch.no_grad():
                losses.append(float(loss_fn("gpt", engine(x), y)))
        if what == "zero" and step == 1:  # a bad batch dropped: nothing is applied
            engine.zero_grad()
        if what == "state" and step == 1:  # the state as before the step: the pass goes
            states.append(engine.optimizer.state_dict())
        applied = engine.step()
        losses.append(float(loss.detach()))
        early.append(engine.last_step_timings.early_groups if applied else None)
    return losses, early


@pytest.mark.parametrize(
    "stage,dtype,fraction",
    [
        (3, torch.bfloat16, None),
        (3, torch.float32, None),
        (2, torch.bfloat16, None),
        (3, torch.bfloat16, 0.5),  # host sub-groups between the ones in files: step() has them
    ],
)
def test_sub_groups_stepped_during_backward_equal_the_step(tmp_path, waits, stage, dtype, fraction):
    kw = {} if fraction is None else {"offload_optimizer_fraction": fraction}
    ref = _engine(tmp_path / "ref", early=False, dtype=dtype, stage=stage, **kw)
    ref_losses, ref_early = _train(ref, "plain")
    engine = _engine(tmp_path / "early", early=True, dtype=dtype, stage=stage, **kw)
    losses, early = _train(engine, "plain")
    assert ref_early == [0] * STEPS
    split = engine.optimizer_split
    groups = -(-split.numel // split.sizing.group)
    in_files = groups - split.host_numel // split.sizing.group  # host ones are whole
    assert early == [in_files] * STEPS, early  # every disk sub-group, waited for
    if fraction is not None:
        assert 0 < in_files < groups
    assert losses == ref_losses
    assert_bit_equal(training_state(engine), training_state(ref))
    engine.close()
    ref.close()


@pytest.mark.parametrize("what", ["lr", "eval", "zero", "state", "twice", "scaled"])
def test_what_happens_between_backward_and_step_is_seen(tmp_path, waits, what):
    """An lr changed after backward is this step's lr (the pass is dropped); an evaluation
    there sees the parameters before the step; ``zero_grad()`` there drops the pass, and so
    does reading the optimizer state (it is the state before the step). A second backward
    (which widens a bf16 gradient shard to fp32 for the sum) and gradients changed in place
    are what the step reads."""
    ref = _engine(tmp_path / "ref", early=False)
    ref_losses, _ = _train(ref, what)
    engine = _engine(tmp_path / "early", early=True)
    losses, early = _train(engine, what)
    assert losses == ref_losses
    assert_bit_equal(training_state(engine), training_state(ref))
    assert early[0] > 0 and early[2] > 0
    dropped = {"lr": 0, "eval": early[0], "zero": None, "state": 0, "twice": 0, "scaled": 0}
    assert early[1] == dropped[what]
    engine.close()
    ref.close()


def test_a_parameter_without_gradient_drops_the_pass(tmp_path, waits):
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            return self.c(torch.tanh(self.b(h)) if use_b else h)

    def run(early: bool, path) -> tuple[dict, list]:
        torch.manual_seed(0)
        engine = zo.initialize(
            Branchy(),
            stage=3,
            offload_optimizer="nvme",
            nvme_path=str(path),
            dtype=torch.float32,
            lr=1e-2,
            sub_group_size=1024,
            step_during_backward=early,
        )
        adopted = []
        for i, use_b in enumerate([True, False, True]):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i))
            engine.backward(engine(x, use_b).square().mean())
            engine.step()
            adopted.append(engine.last_step_timings.early_groups)
        state = training_state(engine)
        engine.close()
        return state, adopted

    ref, _ = run(False, tmp_path / "ref")
    state, adopted = run(True, tmp_path / "early")
    assert_bit_equal(state, ref)
    assert adopted[0] > 0 and adopted[1] == 0 and adopted[2] > 0


def _train_with_a_fault(tmp_path, fault) -> tuple[list[int], zo.Engine]:
    """``_train``'s plain loop with ``fault(engine)`` called before step 1's backward; the
    sub-groups each step adopted, and the engine, which must equal a run without the pass."""
    ref = _engine(tmp_path / "ref", early=False)
    _train(ref, "plain")
    engine = _engine(tmp_path / "early", early=True)
    gen = torch.Generator().manual_seed(1)
    adopted = []
    for step in range(STEPS):
        x, y = batch("gpt", 4, gen)
        loss = loss_fn("gpt", engine(x), y)
        if step == 1:
            fault(engine)
        engine.backward(loss)
        engine.step()
        adopted.append(engine.last_step_timings.early_groups)
    assert_bit_equal(training_state(engine), training_state(ref))
    ref.close()
    return adopted, engine


def test_a_failed_write_during_backward_costs_nothing_but_time(tmp_path, waits):
    """The disk fails the pass's first write (a full disk, say): the step drops the pass
    and steps every sub-group itself."""

    def fail_a_write(engine: zo.Engine) -> None:
        engine.swappers[0].engine.backend = FaultBackend("write", errno_=errno.ENOSPC, times=1)

    adopted, engine = _train_with_a_fault(tmp_path, fail_a_write)
    assert adopted[0] > 0 and adopted[1] == 0 and adopted[2] > 0
    engine.close()


class _RoomForValuesOnly:
    """The real disk with 8 KiB free: a sub-group's new bf16 values (4 KiB) find room for
    their file, its new state (12 KiB) does not."""

    def __getattr__(self, name):
        return getattr(FILES, name)

    def free_bytes(self, path) -> int:
        return 8192


def test_a_disk_too_full_for_the_new_state_costs_nothing_but_time(tmp_path, waits):
    """The pass writes a sub-group's new values, then finds no room for its new state: the
    step drops the pass and steps every sub-group in the files it has. (The refused file's
    buffer was lost once, and the step's read-ahead waited for it until ``acquire_timeout``.)"""
    swappers = []

    def fill_the_disk(engine: zo.Engine) -> None:
        (swapper,) = [s for s in engine.swappers if any(s.rank_dir.glob("*adam*"))]
        swapper.acquire_timeout = 5.0  # a lost buffer fails the test rather than waits
        swapper._folder.disk = _RoomForValuesOnly()
        swappers.append(swapper)

    adopted, engine = _train_with_a_fault(tmp_path, fill_the_disk)
    assert adopted[0] > 0 and adopted[1] == 0 and adopted[2] == 0
    assert swappers[0].pool.available == swappers[0].pool.count
    engine.close()


def test_dropped_passes_leave_no_files_and_no_thread(tmp_path, waits):
    engine = _engine(tmp_path, early=True)
    gen = torch.Generator().manual_seed(1)
    x, y = batch("gpt", 4, gen)
    engine.backward(loss_fn("gpt", engine(x), y))
    engine.zero_grad()
    engine.backward(loss_fn("gpt", engine(x), y))  # a pass that no step() ends
    (swapper,) = [s for s in engine.swappers if any(s.rank_dir.glob("*adam*"))]
    engine.close()
    assert not any(t.name == "zo-early-update" for t in threading.enumerate())
    assert not swapper.rank_dir.exists()


def test_the_step_adopts_only_what_the_pass_finished(tmp_path):
    """Without waiting, ``step()`` takes whatever the pass finished by then — any number
    of sub-groups — and steps the rest itself: equal either way."""
    ref = _engine(tmp_path / "ref", early=False)
    ref_losses, _ = _train(ref, "plain")
    engine = _engine(tmp_path / "early", early=True)
    losses, _ = _train(engine, "plain")
    assert losses == ref_losses
    assert_bit_equal(training_state(engine), training_state(ref))


def _waiting_check(self, *args):
    self.wait_idle()
    return _check(self, *args)


_check = EarlyUpdate.check


def _two_ranks(rank: int, world: int, path: str, early: bool) -> tuple[dict, list]:
    EarlyUpdate.check = _waiting_check  # this process only: every ready sub-group adopted
    engine = _engine(f"{path}/{rank}", early=early)
    _, adopted = _train(engine, "plain", rank, world)
    state = training_state(engine)
    engine.close()
    return state, adopted


def test_two_ranks_step_during_backward_like_after_it(tmp_path):
    ref = run_ranks(2, _two_ranks, str(tmp_path / "ref"), False)
    early = run_ranks(2, _two_ranks, str(tmp_path / "early"), True)
    for (a, _), (b, adopted) in zip(ref, early):
        assert_bit_equal(a, b)
        assert all(n > 0 for n in adopted), adopted


def test_a_failed_read_in_the_step_keeps_the_state_as_before(tmp_path, monkeypatch, waits):
    """A read fails in the step that adopts the pass: as without the pass, nothing changed
    (the new state of the sub-groups stepped in backward takes over only as the step hands
    their values on), and a retry of the window trains on as the reference does."""
    passes: list[EarlyUpdate] = []
    start = EarlyUpdate.__init__

    def started(self, *args):
        start(self, *args)
        passes.append(self)

    monkeypatch.setattr(EarlyUpdate, "__init__", started)
    ref = _engine(tmp_path / "ref", early=False, dtype=torch.float32, stage=2)
    engine = _engine(tmp_path / "early", early=True, dtype=torch.float32, stage=2)
    for e in (ref, engine):
        gen = torch.Generator().manual_seed(1)
        x, y = batch("gpt", 4, gen)
        e.backward(loss_fn("gpt", e(x), y))
        e.step()
        x, y = batch("gpt", 4, gen)
        e.backward(loss_fn("gpt", e(x), y))
        for running in passes:
            running.wait_idle()  # its reads are done: the step's first read fails
        (swapper,) = [s for s in e.swappers if any(s.rank_dir.glob("*adam*"))]
        swapper.engine.backend = FaultBackend("read", errno_=errno.EIO, times=1)
        with pytest.raises(zo.SwapIOError, match="read failed: EIO"):
            e.step()
        swapper.engine.backend = FaultBackend("none")
        e.zero_grad()
        e.backward(loss_fn("gpt", e(x), y))
        e.step()
    assert len(passes) == 3 and passes[0].done  # the failed step had one to adopt
    assert_bit_equal(training_state(engine), training_state(ref))
    engine.close()
    ref.close()


class _SharedInTwoSegments(torch.nn.Module):
    """A layer used in two reentrant checkpointed segments: its gradient arrives in two
    pieces, the second after its unit was reduced (a late piece)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared = torch.nn.Linear(16, 48), torch.nn.Linear(48, 48)
        self.a, self.b, self.out = (
            torch.nn.Linear(48, 48),
            torch.nn.Linear(48, 48),
            torch.nn.Linear(48, 8),
        )

    def segment(self, layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(torch.tanh(layer(h))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in (self.a, self.b):
            h = torch.utils.checkpoint.checkpoint(self.segment, layer, h, use_reentrant=True)
        return self.out(h)


def test_a_late_gradient_piece_stops_the_pass_before_the_step_runs(tmp_path, waits):
    """With a late piece the step reduces it and steps every sub-group itself; the pass
    must be gone by then (two drivers of one swapper wait on each other for its buffers)."""
    states = []
    for early in (False, True):
        torch.manual_seed(0)
        engine = zo.initialize(
            _SharedInTwoSegments(),
            stage=2,
            offload_optimizer="nvme",
            nvme_path=str(tmp_path / str(early)),
            lr=1e-2,
            sub_group_size=512,
            gradient_accumulation_steps=2,
            step_during_backward=early,
        )
        for swapper in engine.swappers:
            swapper.acquire_timeout = 10  # a wait for a buffer is a hang here
        gen = torch.Generator().manual_seed(3)
        for _ in range(2 * STEPS):
            x = torch.randn(4, 16, generator=gen, requires_grad=True)
            engine.backward(engine(x).square().mean())
            engine.step()
        states.append(training_state(engine))
        engine.close()
    assert_bit_equal(*states)
