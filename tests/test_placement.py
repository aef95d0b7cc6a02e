"""Where the engine puts things: stage 3 never has more than one unit of the model on the
device while it builds its units or exports them, and the default device follows
LOCAL_RANK over the GPUs a process can see and is made current.

On a CPU the device is the host, so "moving" costs nothing and hides a whole-model copy.
The tests watch the two ways values can reach the device instead: parameters that report
every ``.to()`` asked of them (``model.to(device)`` goes through it), and the engine's one
placement function, counted."""

from __future__ import annotations

import torch
import torch.nn as nn
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.device import placement


class ReportingParameter(nn.Parameter):
    """A parameter that records each ``.to()`` asked of it (as ``model.to`` does)."""

    moves: list[int] = []

    def to(self, *args, **kwargs):  # type: ignore[override]
        ReportingParameter.moves.append(self.numel())
        return super().to(*args, **kwargs)


def _reporting(model: nn.Module) -> nn.Module:
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = ReportingParameter(p.detach(), p.requires_grad)
    return model


def _counting(monkeypatch) -> list[int]:
    """Bytes of each copy through the engine's placement function."""
    moved: list[int] = []
    real = placement.to_device

    def counted(tensor, device, dtype=None):
        moved.append(tensor.numel() * tensor.element_size())
        return real(tensor, device, dtype)

    monkeypatch.setattr(placement, "to_device", counted)
    return moved


def test_stage3_initialize_moves_one_unit_at_a_time(monkeypatch):
    torch.manual_seed(0)
    model = _reporting(TinyGPT())
    ReportingParameter.moves.clear()
    moved = _counting(monkeypatch)
    engine = zo.initialize(model, stage=3, offload_param="cpu", offload_optimizer="cpu")
    assert ReportingParameter.moves == []  # never model.to(device): the whole model at once
    largest = max(u.layout.padded_numel for u in engine.units) * 4  # one unit in fp32
    unit_moves = [n for n in moved if n > 0]
    assert len(unit_moves) >= len(engine.units) and max(unit_moves) <= largest
    x, y = batch("gpt", 4, torch.Generator().manual_seed(0))
    engine.backward(loss_fn("gpt", engine(x), y))
    assert engine.step()
    engine.close()


def test_full_state_dict_moves_one_unit_at_a_time(monkeypatch):
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), stage=3, offload_optimizer="cpu")
    moved = _counting(monkeypatch)
    state = engine.full_state_dict()
    largest = max(u.shard_numel for u in engine.units) * 4
    assert len(moved) >= len(engine.units) and max(moved) <= largest
    assert sum(moved) >= engine.trainable_numel * 4  # every shard went, piece by piece
    assert state["wte.weight"].shape == (64, 32)
    engine.close()


class FakeCuda:
    """torch.cuda as a process with ``count`` visible GPUs sees it (no GPU needed)."""

    def __init__(self, monkeypatch, count: int) -> None:
        self.current: list[torch.device] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.current.append(d))


def test_default_device_is_local_rank_modulo_visible_gpus(monkeypatch):
    fake = FakeCuda(monkeypatch, 1)  # one visible GPU per process (SLURM --gpus-per-task)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert placement.select_device(None) == torch.device("cuda", 0)
    assert fake.current == [torch.device("cuda", 0)]
    fake = FakeCuda(monkeypatch, 4)  # every GPU visible: rank 3 takes the fourth
    assert placement.select_device(None) == torch.device("cuda", 3)
    assert fake.current == [torch.device("cuda", 3)]
    monkeypatch.delenv("LOCAL_RANK")
    assert placement.select_device(None) == torch.device("cuda", 0)


def test_a_requested_cuda_device_is_made_current(monkeypatch):
    fake = FakeCuda(monkeypatch, 8)
    assert placement.select_device(torch.device("cuda", 5)) == torch.device("cuda", 5)
    assert fake.current == [torch.device("cuda", 5)]
    assert placement.select_device(torch.device("cpu")) == torch.device("cpu")
    assert fake.current == [torch.device("cuda", 5)]
