"""Parameters without a gradient are not stepped, like ``torch.optim.AdamW`` skips a parameter
whose ``.grad`` is None: no moment update, no weight decay, and its own step count (bias
correction) stays. ``step()`` with nothing to apply says so. Every stage and optimizer tier,
against torch AdamW on the same sequence of calls; checkpoints carry the per-parameter
step counts."""

from __future__ import annotations

import copy
import errno

import pytest
import torch
import torch.nn as nn
from support.swap_faults import FaultBackend

import zero_offload as zo
from zero_offload.errors import SwapIOError

LR, WD = 1e-2, 0.1


class ABC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(96, 96) for _ in range(3))

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.c(h)


def _x(i: int) -> torch.Tensor:
    return torch.randn(8, 96, generator=torch.Generator().manual_seed(i))


# (what the loop does, whether an update is applied): "step" = backward + step,
# "skip_b" = the same without module b, "bare" = step() alone, "zero" = backward, zero_grad,
# step
SCRIPT = [
    ("step", True),
    ("bare", False),
    ("zero", False),
    ("skip_b", True),
    ("skip_b", True),
    ("step", True),
]


def _run_engine(engine: zo.Engine, script: list, start: int = 0) -> list[bool]:
    applied = []
    for i, (what, _) in enumerate(script, start):
        if what != "bare":
            engine.backward(engine(_x(i), use_b=what != "skip_b").square().mean())
        if what == "zero":
            engine.zero_grad()
        applied.append(engine.step())
    return applied


def _run_torch(model: nn.Module, script: list) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for i, (what, _) in enumerate(script):
        if what != "bare":
            model(_x(i), use_b=what != "skip_b").square().mean().backward()
        if what == "zero":
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


CASES = (
    [(0, "none", None)]
    + [(s, o, None) for s in (1, 2, 3) for o in ("none", "cpu", "nvme")]
    + [(2, "nvme", 128 << 10), (3, "nvme", 128 << 10)]
)  # a small budget: gradients on NVMe too


def _engine(model: nn.Module, stage: int, offload: str, limit: int | None, nvme, **kw) -> zo.Engine:
    return zo.initialize(
        model,
        stage=stage,
        offload_optimizer=offload,
        nvme_path=nvme,
        sub_group_size=4096,
        host_memory_limit=limit,
        lr=LR,
        weight_decay=WD,
        dtype=torch.float32,
        reduce_bucket_size=96 * 96,
        **kw,
    )


@pytest.mark.parametrize("stage,offload,limit", CASES)
def test_parameters_without_gradient_are_not_stepped(tmp_path, stage, offload, limit):
    torch.manual_seed(0)
    model = ABC()
    ref = _run_torch(copy.deepcopy(model), SCRIPT)
    engine = _engine(model, stage, offload, limit, tmp_path)
    if limit is not None:
        assert engine.grads is None, "this case is meant to keep the gradients on NVMe"
    assert _run_engine(engine, SCRIPT) == [applied for _, applied in SCRIPT]
    assert engine.optimizer_steps == 4
    sd = engine.full_state_dict()
    engine.close()
    worst = max((sd[k] - ref[k]).abs().max().item() for k in ref) / LR
    assert worst <= 1e-3, f"max |engine - torch| = {worst:.4f} lr"


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_checkpoint_carries_per_parameter_steps(tmp_path, offload):
    """Saved after b missed two updates, resumed in a new engine: the same parameters as
    training straight through (b's bias correction continues from its own count)."""
    first, rest = SCRIPT[:5], SCRIPT[5:] + [("step", True)]
    torch.manual_seed(0)
    model = ABC()
    straight = _engine(copy.deepcopy(model), 2, offload, None, tmp_path / "a")
    _run_engine(straight, first + rest)
    expected = straight.full_state_dict()
    straight.close()

    saver = _engine(copy.deepcopy(model), 2, offload, None, tmp_path / "b")
    _run_engine(saver, first)
    assert saver.training_state()["missed_updates"] == {"b.weight": 2, "b.bias": 2}
    saver.save_checkpoint(tmp_path / "ckpt", tag="t")
    saver.close()
    torch.manual_seed(1)
    resumed = _engine(ABC(), 2, offload, None, tmp_path / "c")
    resumed.load_checkpoint(tmp_path / "ckpt", tag="t")
    _run_engine(resumed, rest, start=len(first))
    got = resumed.full_state_dict()
    resumed.close()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_training_state_without_per_parameter_steps_still_loads():
    """Files written before per-parameter step counts: every parameter took every update."""
    engine = _engine(ABC(), 1, "none", None, None)
    _run_engine(engine, [("skip_b", True)])
    state = engine.training_state()
    assert state["missed_updates"] == {"b.weight": 1, "b.bias": 1}
    del state["missed_updates"]
    engine.load_training_state(state)
    assert engine.training_state()["missed_updates"] == {}
    engine.close()


def test_device_updater_steps_ranges_with_their_own_counts():
    """The accelerator updater (torch's fused AdamW; run here on the CPU) given ranges with
    different step counts matches torch AdamW on separate parameters."""
    from zero_offload.config import build_config
    from zero_offload.update.updaters import DeviceAdam

    torch.manual_seed(0)
    p1, p2 = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(7))
    opt = torch.optim.AdamW([p1, p2], lr=LR, weight_decay=WD)
    updater = DeviceAdam(
        torch.cat([p1.detach(), p2.detach()]), build_config(None, lr=LR, weight_decay=WD)
    )
    # per update: which parameters have a gradient, and the ranges the stepper would give
    plan = [
        ((True, True), None),
        ((True, False), [(0, 5, 2, True)]),
        ((True, True), [(0, 5, 3, True), (5, 12, 2, True)]),
    ]
    for i, (has, ranges) in enumerate(plan):
        g = torch.randn(12, generator=torch.Generator().manual_seed(i))
        p1.grad = g[:5].clone() if has[0] else None
        p2.grad = g[5:].clone() if has[1] else None
        opt.step()
        updater.update(g.clone(), 1.0, lambda lo, hi, v: None, ranges)
    assert updater.steps == 3
    torch.testing.assert_close(updater.master, torch.cat([p1.detach(), p2.detach()]))


@pytest.mark.parametrize("limit", [None, 128 << 10])  # gradients in memory, in files
def test_a_step_retried_after_a_failed_read_counts_a_missed_update_once(tmp_path, limit):
    """A step that fails before any state changed is retried as the same update: a
    parameter without gradient has missed it once, not once per try."""
    script = [("step", True), ("skip_b", True), ("step", True)]
    torch.manual_seed(0)
    model = ABC()
    ref = _run_torch(copy.deepcopy(model), script)
    # the fault counts I/O calls: all of them the step's
    engine = _engine(model, 2, "nvme", limit, tmp_path, step_during_backward=False)
    io = engine.swappers[0].engine
    for i, (what, _) in enumerate(script):
        engine.backward(engine(_x(i), use_b=what != "skip_b").square().mean())
        if i == 1:
            io.backend = FaultBackend("read", errno_=errno.EIO, times=1)
            with pytest.raises(SwapIOError):
                engine.step()
            io.backend = FaultBackend("none")
        assert engine.step()
    assert engine.training_state()["missed_updates"] == {"b.weight": 1, "b.bias": 1}
    sd = engine.full_state_dict()
    engine.close()
    worst = max((sd[k] - ref[k]).abs().max().item() for k in ref) / LR
    assert worst <= 1e-3, f"max |engine - torch| = {worst:.4f} lr"
