"""Frozen parameters (``requires_grad=False``, a partial fine-tune): every stage and optimizer
tier leaves them exactly as they were and trains the rest like ``torch.optim.AdamW`` (which
skips parameters without gradients: no weight decay); stage 3 releases an all-frozen module's
gathered parameters in backward as soon as its backward is done."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import zero_offload as zo

LR, WD, STEPS = 1e-2, 0.1, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(*(nn.Linear(96, 96) for _ in range(5)))
    m[0].requires_grad_(False)  # a whole module
    m[2].weight.requires_grad_(False)  # its bias still trains
    m[3].requires_grad_(False)
    return m


def _train(model: nn.Module, steps: int, **kwargs) -> zo.Engine:
    engine = zo.initialize(model, lr=LR, weight_decay=WD, dtype=torch.float32, **kwargs)
    for i in range(steps):
        x = torch.randn(8, 96, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        assert engine.step()
    return engine


def _reference(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD
    )
    for i in range(steps):
        x = torch.randn(8, 96, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


CASES = (
    [(0, "none", None)]
    + [(s, o, None) for s in (1, 2, 3) for o in ("none", "cpu", "nvme")]
    + [(2, "nvme", 128 << 10), (3, "nvme", 128 << 10)]
)  # a small budget: gradients on NVMe too


@pytest.mark.parametrize("stage,offload,limit", CASES)
def test_frozen_parameters_stay_and_the_rest_trains_like_adamw(tmp_path, stage, offload, limit):
    model = _model()
    initial = copy.deepcopy(model.state_dict())
    ref = _reference(copy.deepcopy(model), STEPS)
    # small sub-groups, several per unit
    engine = _train(
        model,
        STEPS,
        stage=stage,
        offload_optimizer=offload,
        nvme_path=tmp_path,
        sub_group_size=4096,
        host_memory_limit=limit,
    )
    if limit is not None:
        assert engine.grads is None, "this case is meant to keep the gradients on NVMe"
    sd = engine.full_state_dict()
    engine.close()
    for name in ("0.weight", "0.bias", "2.weight", "3.weight", "3.bias"):
        assert torch.equal(sd[name], initial[name]), f"{name} is frozen but changed"
    for name in ("1.weight", "2.bias", "4.weight"):
        assert not torch.equal(sd[name], initial[name]), f"{name} did not train"
    worst = max((sd[k] - ref[k]).abs().max().item() for k in ref) / LR
    assert worst <= 0.03, f"max |diff| = {worst:.4f} lr"


def test_all_frozen_modules_are_released_during_backward():
    """A long frozen trunk under a trainable head: without a release after each module's
    backward, every trunk module would stay gathered until backward ends."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(128, 128) for _ in range(10)))
    model[:9].requires_grad_(False)
    x = torch.randn(4, 128, requires_grad=True)  # so that gradients flow through the trunk
    engine = zo.initialize(model, stage=3, prefetch_depth=1, lr=LR, dtype=torch.float32)
    unit = max(u.full_bytes for u in engine.units)
    for _ in range(2):  # the second step prefetches in the recorded order
        engine.backward(engine(x).square().mean())
        engine.step()
    peak = engine.memory_report().peak_gathered_param_bytes
    assert peak <= (1 + 2) * unit, f"{peak / unit:.1f} units gathered at once"
    assert x.grad is not None and x.grad.abs().sum() > 0
    engine.close()


@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (2, "none"), (3, "nvme")])
def test_frozen_parameters_hold_no_optimizer_state(tmp_path, stage, offload):
    model = _model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = _train(model, 1, stage=stage, offload_optimizer=offload, nvme_path=tmp_path)
    rep = engine.memory_report()
    tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[offload]
    # 12 bytes a trainable parameter (plus alignment padding), nothing for the frozen ones
    assert engine.trainable_numel < engine.shard_numel
    assert rep.bytes[tier]["optimizer"] == 12 * engine.trainable_numel
    assert engine.trainable_numel - trainable < 64 * len(engine.units)
    if offload != "nvme":
        assert engine.grads is not None and engine.grads.numel() == engine.trainable_numel
    engine.close()


@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (3, "nvme")])
def test_checkpoint_with_frozen_parameters_resumes_exactly(tmp_path, stage, offload):
    kwargs = dict(stage=stage, offload_optimizer=offload, nvme_path=tmp_path / "nvme")
    (tmp_path / "nvme").mkdir()
    engine = _train(_model(), 2, **kwargs)
    engine.save_checkpoint(tmp_path / "ckpt")
    straight = _train_more(engine)
    engine.close()
    torch.manual_seed(123)  # other starting values, frozen ones too: all must come from the file
    other = nn.Sequential(*(nn.Linear(96, 96) for _ in range(5)))
    other[0].requires_grad_(False)
    other[2].weight.requires_grad_(False)
    other[3].requires_grad_(False)
    resumed = zo.initialize(other, lr=LR, weight_decay=WD, dtype=torch.float32, **kwargs)
    resumed.load_checkpoint(tmp_path / "ckpt")
    again = _train_more(resumed)
    resumed.close()
    for name in straight:
        assert torch.equal(straight[name], again[name]), name
    saved = zo.consolidate_checkpoint(tmp_path / "ckpt")
    assert torch.equal(saved["0.weight"], _model().state_dict()["0.weight"])


def _train_more(engine: zo.Engine) -> dict[str, torch.Tensor]:
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(99))
    engine.backward(engine(x).square().mean())
    assert engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "cpu"), (2, "nvme"), (3, "nvme")])
def test_everything_frozen_steps_without_changing_anything(tmp_path, stage, offload):
    model = _model().requires_grad_(False)
    initial = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 96, requires_grad=True)  # a gradient still flows to the input
    engine = zo.initialize(
        model,
        stage=stage,
        offload_optimizer=offload,
        nvme_path=tmp_path,
        lr=LR,
        weight_decay=WD,
        dtype=torch.float32,
    )
    assert engine.trainable_numel == 0
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        assert not engine.step(), "no parameter had a gradient: the step applies nothing"
    sd = engine.full_state_dict()
    engine.close()
    assert all(torch.equal(sd[k], v) for k, v in initial.items())
    assert x.grad is not None


def test_unfreezing_after_initialize_is_a_clear_error():
    model = _model()
    engine = zo.initialize(model, stage=2, lr=LR, dtype=torch.float32)
    model[0].requires_grad_(True)
    with pytest.raises(
        RuntimeError, match=r"'0\.(weight|bias)'.*set requires_grad before initialize"
    ):
        engine.backward(engine(torch.randn(2, 96)).square().mean())
    engine.close()
