"""Gradient accumulation is exact on every tier: the clipping norm is the norm of the summed
gradient (gradients on NVMe included), and a checkpoint is never taken from the middle of an
accumulation window (it would lose the gradients accumulated so far)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import zero_offload as zo

LR, WD, CLIP, GAS = 1e-2, 0.1, 0.05, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 96)
    )


def _x(i: int) -> torch.Tensor:
    return torch.randn(8, 96, generator=torch.Generator().manual_seed(i))


def _train(model: nn.Module, steps: int, loop: str, **kwargs) -> tuple[zo.Engine, list[float]]:
    """``loop`` "gas": gradient_accumulation_steps=2, step() after each backward; "plain":
    two backwards, then one step() (torch style, gradient_accumulation_steps=1)."""
    engine = zo.initialize(
        model,
        lr=LR,
        weight_decay=WD,
        max_grad_norm=CLIP,
        gradient_accumulation_steps=GAS if loop == "gas" else 1,
        dtype=torch.float32,
        sub_group_size=4096,
        **kwargs,
    )
    norms = []
    for i in range(steps * GAS):
        loss = engine(_x(i)).square().mean()
        engine.backward(loss if loop == "gas" else loss / GAS)
        if (loop == "gas" or i % GAS == GAS - 1) and engine.step():
            norms.append(engine.last_grad_norm)
    return engine, norms


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("loop", ["gas", "plain"])
def test_clipping_norm_with_gradients_on_nvme_is_the_summed_gradients(tmp_path, stage, loop):
    """Offloading changes no bit: the NVMe tier with gradients in files gives the norms and
    parameters of the CPU tier, and the norm is torch's norm of the accumulated gradient."""
    model = _model()
    ref = copy.deepcopy(model)
    for i in range(GAS):
        (ref(_x(i)).square().mean() / GAS).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()

    cpu, cpu_norms = _train(copy.deepcopy(model), 3, loop, stage=stage, offload_optimizer="cpu")
    disk, disk_norms = _train(
        copy.deepcopy(model),
        3,
        loop,
        stage=stage,
        offload_optimizer="nvme",
        nvme_path=tmp_path,
        host_memory_limit=128 << 10,
    )
    assert disk.grads is None, "this case is meant to keep the gradients on NVMe"
    assert disk_norms[0] == pytest.approx(expected, rel=1e-5)
    # fp64 sums of squares per sub-group or over the shard: equal to far below fp32's
    # resolution, so the clip factors (and parameters) are the same
    assert disk_norms == pytest.approx(cpu_norms, rel=1e-12)
    a, b = cpu.full_state_dict(), disk.full_state_dict()
    cpu.close()
    disk.close()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_checkpoint_in_the_middle_of_an_accumulation_window_is_refused(tmp_path):
    """A checkpoint does not carry accumulated gradients: saving mid-window would resume with
    half the batch. It is refused with the fix, writes nothing, and works at the boundary."""
    engine = zo.initialize(
        _model(), lr=LR, gradient_accumulation_steps=GAS, dtype=torch.float32, stage=2
    )
    engine.backward(engine(_x(0)).square().mean())
    engine.step()  # the first of two micro-steps: gradients accumulated, no update yet
    assert engine.is_accumulation_boundary
    with pytest.raises(RuntimeError, match="is_accumulation_boundary"):
        engine.save_checkpoint(tmp_path, tag="mid")
    assert not (tmp_path / "mid").exists()
    engine.backward(engine(_x(1)).square().mean())
    assert engine.step()
    engine.save_checkpoint(tmp_path, tag="boundary")
    assert (tmp_path / "boundary").exists()
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_grad_mid_window_starts_the_window_again(tmp_path, stage):
    """The Ctrl-C loop (``zero_grad()``, then ``save_checkpoint``) in the middle of a window:
    the window's gradients are dropped, so the window starts again from its first
    micro-batch, in this engine and in one resumed from the checkpoint, and both end bit for
    bit where a run that never saw the dropped micro-batch ends."""

    def run(engine, batches):
        applied = []
        for i in batches:
            engine.backward(engine(_x(i)).square().mean())
            applied.append(engine.step())
        return applied

    kw = dict(lr=LR, gradient_accumulation_steps=GAS, dtype=torch.float32, stage=stage)
    straight = zo.initialize(_model(), **kw)
    assert run(straight, [0, 1, 2, 3]) == [False, True, False, True]
    want = straight.full_state_dict()
    straight.close()

    engine = zo.initialize(_model(), **kw)
    run(engine, [0, 1, 9])  # the window of 9 is interrupted after its first micro-batch
    engine.zero_grad()
    assert not engine.is_accumulation_boundary  # the next micro-batch opens a window
    engine.save_checkpoint(tmp_path, tag="interrupted")
    assert run(engine, [2, 3]) == [False, True]
    got = engine.full_state_dict()
    engine.close()
    resumed = zo.initialize(_model(), **kw)
    resumed.load_checkpoint(tmp_path, tag="interrupted")
    assert run(resumed, [2, 3]) == [False, True]
    again = resumed.full_state_dict()
    resumed.close()
    for name in want:
        assert torch.equal(got[name], want[name]) and torch.equal(again[name], want[name]), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_step_agrees_in_one_fp64_exchange(stage):
    """float16 with clipping: the gradient flags, the overflow check and the norm travel in
    one all-reduce of fp64 values (the same dtype on every device, so the clip factor is the
    same bit for bit everywhere) - one host read per step, not one per question."""
    engine = zo.initialize(
        _model(),
        lr=LR,
        max_grad_norm=CLIP,
        dtype=torch.float16,
        stage=stage,
        offload_optimizer="cpu" if stage else "none",
    )
    calls = []
    all_reduce = engine.comm.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    engine.comm.all_reduce = counting  # this engine's own communicator, not torch
    for i in range(3):
        engine.backward(engine(_x(i)).square().mean())
        calls.clear()
        engine.step()
        grads = [torch.float16] * len(engine.units) if stage == 0 else []  # stage 0's reduction
        assert calls == grads + [torch.float64], f"step {i}: all-reduces {calls}"
    assert engine.last_grad_norm is not None
    engine.close()
