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


def test_a_cpu_device_without_low_precision_matmuls_warns_once(monkeypatch, caplog):
    """A CPU device computing in bf16 where the CPU has no bf16 matrix instructions (torch
    then multiplies in a reference kernel, tens of times slower than fp32) gets one warning
    that names the fix; fp32, a GPU, or a CPU that has them get none."""
    monkeypatch.setattr(placement, "native_cpu_matmul", lambda dtype: dtype == torch.float32)
    placement.warn_if_slow_on_cpu.cache_clear()
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger=placement.__name__):
        engine = zo.initialize(TinyGPT(), stage=3, dtype=torch.bfloat16, lr=1e-3)
        engine.close()
        zo.initialize(TinyGPT(), stage=3, dtype=torch.bfloat16, lr=1e-3).close()
    warned = [r.getMessage() for r in caplog.records if "matrix instructions" in r.getMessage()]
    assert len(warned) == 1 and "dtype=torch.float32" in warned[0]
    assert not placement.warn_if_slow_on_cpu(cpu, torch.float32)
    assert not placement.warn_if_slow_on_cpu(torch.device("cuda", 0), torch.float16)
    monkeypatch.setattr(placement, "native_cpu_matmul", lambda dtype: True)
    placement.warn_if_slow_on_cpu.cache_clear()
    assert not placement.warn_if_slow_on_cpu(cpu, torch.bfloat16)
    placement.warn_if_slow_on_cpu.cache_clear()


def test_the_matrix_instructions_check_is_answered_by_this_torch():
    """The check asks oneDNN (a private torch op: a torch without it would silently never
    warn, so the torch releases we test must have it); fp32 never needs it."""
    assert placement.native_cpu_matmul(torch.float32)
    for name in ("_is_mkldnn_bf16_supported", "_is_mkldnn_fp16_supported"):
        assert isinstance(getattr(torch.ops.mkldnn, name)(), bool)
