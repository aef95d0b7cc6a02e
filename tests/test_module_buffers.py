"""Module buffers (BatchNorm running statistics): rank 0's are broadcast at initialize and
before each training forward, as DistributedDataParallel does, so exports agree on every
rank; and pretrained files with buffers — any saved ``state_dict()``, or what
``consolidate_checkpoint`` writes — initialize a model, buffers included."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from support.distributed import run_ranks

import zero_offload as zo

STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 8))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own micro-batch, with different statistics per rank."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=gen) * (1 + rank) + rank, torch.randn(4, 8, generator=gen)


def _train(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 3):
        for sync in (True, False):
            model = _net()
            if rank == 1:  # a rank that starts from other buffers is brought in line too
                model[0].running_mean.fill_(5.0)
            engine = zo.initialize(model, stage=stage, lr=1e-2, broadcast_buffers=sync)
            for step in range(STEPS):
                x, y = _data(step, rank)
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
            # buffers are whole on every rank; stage 3's parameters are not (state_dict() would
            # refuse them while the engine is open)
            local = {k: v.clone() for k, v in model.named_buffers() if "running" in k}
            full = engine.full_state_dict()
            exported = {k: v for k, v in full.items() if "running" in k}
            engine.close()  # collective at stage 3: gathers the parameters back
            closed = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
            handed_back = all(
                torch.equal(v, full[k]) for k, v in model.state_dict().items() if "running" not in k
            )
            out[(stage, sync)] = (local, exported, closed, handed_back)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(2, _train)


def _rank0_reference() -> dict[str, torch.Tensor]:
    """DDP's answer: the statistics of rank 0's micro-batches only."""
    bn = _net()[0]
    for step in range(STEPS):
        bn(_data(step, 0)[0])
    return {f"0.{k}": v for k, v in bn.state_dict().items() if "running" in k}


@pytest.mark.parametrize("stage", [1, 3])
def test_buffers_follow_rank0_and_exports_agree_on_every_rank(ranks, stage):
    want = _rank0_reference()
    r0, r1 = ranks[0][(stage, True)], ranks[1][(stage, True)]
    for name, value in want.items():
        torch.testing.assert_close(r0[0][name], value, rtol=1e-6, atol=1e-6)
        for part in (1, 2):  # full_state_dict, and the model after close()
            assert torch.equal(r0[part][name], r1[part][name]), name
            torch.testing.assert_close(r0[part][name], value, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_close_hands_back_the_trained_parameters_on_every_rank(ranks, stage):
    assert all(rank[(stage, sync)][3] for rank in ranks for sync in (True, False))


@pytest.mark.parametrize("stage", [1, 3])
def test_broadcast_buffers_false_keeps_each_ranks_own(ranks, stage):
    r0, r1 = ranks[0][(stage, False)], ranks[1][(stage, False)]
    assert not torch.equal(r0[0]["0.running_mean"], r1[0]["0.running_mean"])
    assert torch.equal(r0[1]["0.running_mean"], r1[1]["0.running_mean"])  # exports: rank 0's


def _bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("stage", [0, 3])
def test_init_weights_loads_a_saved_state_dict_with_buffers(tmp_path, stage):
    source = _net()
    source.train()
    for step in range(2):
        source(_data(step, 0)[0])  # running statistics that differ from a fresh model's
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    model = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 8))
    engine = zo.initialize(model, stage=stage, init_weights=tmp_path / "model.safetensors")
    got = engine.full_state_dict()
    for name, value in state.items():
        assert torch.equal(got[name], value.float() if value.is_floating_point() else value), name
    buffers = dict(model.named_buffers())
    assert all(torch.equal(buffers[n].cpu(), state[n]) for n in buffers)
    engine.close()


def test_init_weights_takes_what_consolidate_checkpoint_writes(tmp_path):
    model = _net()
    engine = zo.initialize(model, stage=3, lr=1e-2)
    for step in range(2):
        x, y = _data(step, 0)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    trained = engine.full_state_dict()
    engine.close()
    zo.consolidate_checkpoint(tmp_path / "ckpt", tag="t", out=tmp_path / "out.safetensors")
    fresh = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 8))
    again = zo.initialize(fresh, stage=2, init_weights=tmp_path / "out.safetensors")
    got = again.full_state_dict()
    assert set(got) == set(trained)
    for name, value in trained.items():
        assert torch.equal(got[name], value), name
    assert torch.equal(_bn_state(fresh)["0.running_var"], trained["0.running_var"])
    again.close()


def test_a_file_without_buffers_keeps_the_models_own(tmp_path):
    source = _net()
    save_file({k: v.clone() for k, v in source.named_parameters()}, str(tmp_path / "w.safetensors"))
    model = _net()
    model[0].running_mean.fill_(3.0)
    engine = zo.initialize(model, stage=3, init_weights=tmp_path / "w.safetensors")
    assert torch.all(engine.full_state_dict()["0.running_mean"] == 3.0)
    engine.close()
