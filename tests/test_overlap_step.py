"""``overlap_step``: with the optimizer on NVMe at stage 3, ``step()`` leaves the update's
sub-groups to run as the next forward reads each unit. The results must be those of the
sequential step bit for bit — in the loops users write (accumulation with clipping, an lr
scheduler stepped between ``step()`` and the next forward, evaluation under ``no_grad``, a
step without backward, a checkpoint right after a step, ``close()``), on one rank and on
several — and the update must really run under the forward, unit by unit."""

from __future__ import annotations

import errno

import pytest
import torch
from support.distributed import run_ranks
from support.equivalence import assert_bit_equal, training_state
from support.models import batch, loss_fn, make
from support.swap_faults import FaultBackend

import zero_offload as zo
from zero_offload.swap.buffers import pool_footprint
from zero_offload.update.nvme.adam import IncompleteStepError

STEPS = 4


def _engine(tmp_path, overlap: bool, param: str = "nvme", **kw):
    torch.manual_seed(0)
    return zo.initialize(
        make("gpt"),
        stage=3,
        offload_optimizer="nvme",
        offload_param=param,
        nvme_path=str(tmp_path),
        dtype=torch.bfloat16,
        lr=1e-2,
        sub_group_size=2048,  # several sub-groups in the tiny model
        overlap_step=overlap,
        **kw,
    )


def _user_loop(engine, rank: int = 0, world: int = 1) -> list[float]:
    """Accumulation 2 with clipping, an lr scheduler stepped right after ``step()``, an
    evaluation forward under ``no_grad`` before the next training forward, and one
    ``step()`` with no backward since the last update. Returns the losses."""
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1 + s))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        for _ in range(2):
            x, y = batch("gpt", 4 * world, gen)
            x, y = x[rank::world], y[rank::world]
            loss = loss_fn("gpt", engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        sched.step()
        if step == 1:
            with torch.no_grad():
                engine.eval()
                losses.append(float(loss_fn("gpt", engine(x), y)))
                engine.train()
        if step == 2:
            assert engine.step() is False  # a micro-step without backward: nothing to apply
            assert engine.step() is False
    return losses


@pytest.mark.parametrize("param", ["nvme", "cpu", "none"])
def test_overlapped_step_is_bit_for_bit_the_sequential_one(tmp_path, param):
    results = {}
    for overlap in (False, True):
        engine = _engine(
            tmp_path / str(overlap),
            overlap,
            param,
            max_grad_norm=0.5,
            gradient_accumulation_steps=2,
        )
        losses = _user_loop(engine)
        results[overlap] = (losses, training_state(engine), engine.optimizer_steps)
        engine.close()
    assert results[True][0] == results[False][0]
    assert_bit_equal(results[True][1], results[False][1])
    assert results[True][2] == results[False][2] == STEPS


def test_the_update_runs_under_the_next_forward_unit_by_unit(tmp_path):
    engine = _engine(tmp_path, True)
    split = engine.optimizer_split
    assert (split.host_numel + split.nvme_numel) / split.sizing.group > 4  # several sub-groups
    gen = torch.Generator().manual_seed(1)
    x, y = batch("gpt", 4, gen)
    engine.backward(loss_fn("gpt", engine(x), y))
    engine.step()
    progress = engine.update_progress
    assert progress is not None and progress[0] < progress[1]  # it runs on after step()
    unit_of = {n: u for u in engine.units for n in u.names}
    seen: list[tuple[int, int]] = []  # (stored, end of the running module's unit)

    def before(module, _args):
        names = [f"{module._name}.{p}" for p, _ in module.named_parameters(recurse=False)]
        progress = engine.update_progress
        if names and names[0] in unit_of and progress is not None:
            unit = unit_of[names[0]]
            seen.append((progress[0], unit.shard_offset + unit.shard_numel))

    for name, module in engine.module.named_modules():
        module._name = name
        module.register_forward_pre_hook(before)
    loss = loss_fn("gpt", engine(x), y)
    assert seen, "the update ended before the forward began"
    assert all(stored >= end for stored, end in seen), seen  # each unit stored before it ran
    stored = [s for s, _ in seen]
    assert stored == sorted(stored) and stored[0] < stored[-1]  # it advanced with the forward
    engine.backward(loss)  # waits for the rest
    assert engine.update_progress is None and engine.optimizer_steps == 1
    engine.close()


def _two_ranks(rank: int, world: int, path: str, overlap: bool) -> dict:
    engine = _engine(path, overlap, max_grad_norm=0.5, gradient_accumulation_steps=2)
    _user_loop(engine, rank, world)
    state = training_state(engine)
    engine.close()
    return state


def test_overlapped_step_on_two_ranks_matches_the_sequential_one(tmp_path):
    seq = run_ranks(2, _two_ranks, str(tmp_path / "seq"), False)
    ovl = run_ranks(2, _two_ranks, str(tmp_path / "ovl"), True)
    for a, b in zip(seq, ovl):
        assert_bit_equal(a, b)


def test_checkpoint_and_close_right_after_step_see_the_whole_update(tmp_path):
    saved = {}
    for overlap in (False, True):
        engine = _engine(tmp_path / str(overlap), overlap)
        gen = torch.Generator().manual_seed(1)
        x, y = batch("gpt", 4, gen)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
        engine.save_checkpoint(tmp_path / f"ckpt{overlap}", tag="t")  # no forward in between
        engine.step()  # and a step() at once, with nothing to apply
        engine.close()
        model = engine.module
        saved[overlap] = {k: v.clone() for k, v in model.state_dict().items()}
        fresh = _engine(tmp_path / f"load{overlap}", overlap)
        fresh.load_checkpoint(tmp_path / f"ckpt{overlap}", tag="t")
        saved[overlap].update({f"loaded.{k}": v for k, v in training_state(fresh).items()})
        fresh.close()
    assert_bit_equal(saved[True], saved[False])


def test_a_failed_read_under_the_forward_raises_there_and_the_state_is_refused(tmp_path):
    engine = _engine(tmp_path, True)
    gen = torch.Generator().manual_seed(1)
    x, y = batch("gpt", 4, gen)
    engine.backward(loss_fn("gpt", engine(x), y))
    engine.step()  # the first sub-groups are stepped here; the rest under the forward
    assert engine.update_progress is not None
    engine.swappers[0].engine.backend = FaultBackend("read", errno_=errno.EIO)
    with pytest.raises(IncompleteStepError, match="load_checkpoint") as err:
        engine(x)
    assert isinstance(err.value.__cause__, OSError)
    assert engine.update_progress is None
    engine.swappers[0].engine.backend = FaultBackend("none")
    with pytest.raises(IncompleteStepError, match="load_checkpoint"):
        engine.step()  # nothing builds on a partly updated state
    engine.close(hand_back=False)


class _CutUnits(torch.nn.Module):
    """Registered in forward order; sub-groups of 1024 cut ``up`` and ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.up = torch.nn.Linear(16, 256, bias=False)
        self.b = torch.nn.Linear(256, 256)  # the largest unit: the pool's buffer size
        self.c = torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(self.up(torch.tanh(self.a(x))))))


def _one_buffer_run(path, overlap: bool) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    footprint = pool_footprint(2 * (256 * 256 + 256))
    engine = zo.initialize(
        _CutUnits(),
        stage=3,
        dtype=torch.bfloat16,
        lr=1e-2,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=str(path),
        host_memory_limit=2 * footprint + footprint // 2,  # the parameters get one buffer
        sub_group_size=1024,
        overlap_step=overlap,
    )
    params = engine.swappers[-1]  # the optimizer's, then the parameters'
    assert params.pool.count == 1
    params.acquire_timeout = 20.0  # a wait for a buffer nothing gives back fails, not hangs
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    state = training_state(engine)
    engine.close()
    return losses, state


def test_a_one_buffer_parameter_pool_trains_with_the_update_under_the_forward(tmp_path):
    """The update paused under the forward may hold the only buffer as the target of a unit
    it has written in part; the read that follows needs it: the update runs on first."""
    ref_losses, ref = _one_buffer_run(tmp_path / "seq", overlap=False)
    losses, state = _one_buffer_run(tmp_path / "ovl", overlap=True)
    assert losses == ref_losses
    assert_bit_equal(state, ref)
