"""``engine.optimizer.state_dict()`` / ``load_state_dict()``, as trainers and users' own loops
call them: the full state on every tier (NVMe included), plain tensors that
``torch.load(weights_only=True)`` reads, and a round trip into a fresh engine that trains on
bit for bit like the engine that never stopped — and like torch's AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
from support import equivalence
from support.distributed import run_ranks
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo

OFFLOADS = ("none", "cpu", "nvme")


def _kwargs(stage, offload, nvme):
    kw = dict(
        stage=stage,
        lr=equivalence.LR,
        weight_decay=equivalence.WD,
        max_grad_norm=equivalence.CLIP,
        offload_optimizer=offload,
        nvme_path=nvme,
        sub_group_size=3000,
    )  # several NVMe sub-groups
    if stage == 3:
        kw["offload_param"] = offload
    return kw


def _steps(engine, rank, world, start, end):
    for i in range(start, end):
        x, y = batch("gpt", 8, torch.Generator().manual_seed(100 + i))
        per = 8 // world
        sl = slice(rank * per, (rank + 1) * per)
        engine.backward(loss_fn("gpt", engine(x[sl]), y[sl]))
        engine.step()


def _torch_adamw(model, steps):
    """torch.optim.AdamW on the same global batches; returns (params, optimizer)."""
    opt = torch.optim.AdamW(model.parameters(), lr=equivalence.LR, weight_decay=equivalence.WD)
    for i in range(steps):
        x, y = batch("gpt", 8, torch.Generator().manual_seed(100 + i))
        loss_fn("gpt", model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), equivalence.CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


def _save_resume(rank, world, folder, stage, offload):
    """Engine A: 3 steps, state_dict to a file, 3 more. Engine B (other initial values):
    load_state_dict from the file, the same 3 steps."""
    torch.manual_seed(0)
    model = TinyGPT()
    initial = copy.deepcopy(model)
    a = zo.initialize(model, **_kwargs(stage, offload, f"{folder}/nvme"))
    _steps(a, rank, world, 0, 3)
    path = f"{folder}/optimizer{rank}.pt"
    torch.save(a.optimizer.state_dict(), path)
    _steps(a, rank, world, 3, 6)
    straight, straight_state = a.full_state_dict(), a.optimizer.state_dict()
    a.close()
    torch.manual_seed(1)
    b = zo.initialize(TinyGPT(), **_kwargs(stage, offload, f"{folder}/nvme"))
    saved = torch.load(path, weights_only=True)  # tensors and plain data only
    b.optimizer.load_state_dict(saved)
    assert b.optimizer_steps == 3
    _steps(b, rank, world, 3, 6)
    resumed, resumed_state = b.full_state_dict(), b.optimizer.state_dict()
    b.close()
    return initial, saved, straight, straight_state, resumed, resumed_state


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", OFFLOADS)
def test_state_dict_round_trip_trains_on_bit_identically(tmp_path, stage, offload):
    initial, saved, straight, straight_state, resumed, resumed_state = _save_resume(
        0, 1, str(tmp_path), stage, offload
    )
    entry = saved["state"][0]
    assert set(entry) >= {"step", "exp_avg", "exp_avg_sq", "master"}
    assert entry["step"].item() == 3
    # the moments are torch's: their sums agree with torch's AdamW after the same 3 steps
    _, opt = _torch_adamw(copy.deepcopy(initial), 3)
    for key in ("exp_avg", "exp_avg_sq"):
        want = sum(s[key].double().abs().sum() for s in opt.state.values())
        got = entry[key].double().abs().sum()
        assert torch.allclose(got, want, rtol=1e-4), (key, got, want)
    # B trained on exactly like A, and both like torch's AdamW
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    for key in ("step", "exp_avg", "exp_avg_sq", "master"):
        assert torch.equal(straight_state["state"][0][key], resumed_state["state"][0][key]), key
    reference, _ = _torch_adamw(copy.deepcopy(initial), 6)
    max_diff_lr, _ = equivalence.compare(resumed, reference)
    assert max_diff_lr <= 0.03, f"max |diff| = {max_diff_lr:.4f} lr"


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_state_dict_round_trip_on_two_ranks(tmp_path, stage):
    """Each rank saves and loads its own shard; loading is collective (parameters are
    all-gathered or re-sharded from the loaded master)."""
    for rank_result in run_ranks(2, _save_resume, str(tmp_path), stage, "nvme"):
        _, saved, straight, _, resumed, _ = rank_result
        assert saved["state"][0]["step"].item() == 3
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), name


@pytest.mark.parametrize("offload", OFFLOADS)
def test_state_dict_of_a_fresh_engine_is_complete(tmp_path, offload):
    torch.manual_seed(0)
    model = TinyGPT()
    engine = zo.initialize(model, **_kwargs(1, offload, tmp_path))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    entry = engine.optimizer.state_dict()["state"][0]
    assert entry["step"].item() == 0
    assert entry["exp_avg"].abs().sum() == 0 and entry["exp_avg_sq"].abs().sum() == 0
    master = entry["master"]
    assert master.numel() >= params.numel()  # unit padding is zeros
    assert torch.equal(master.sort().values[-params.numel() :], params.sort().values)
    engine.close()


def test_a_state_dict_of_another_layout_or_optimizer_is_refused(tmp_path):
    torch.manual_seed(0)
    one = zo.initialize(TinyGPT(), **_kwargs(1, "nvme", tmp_path))
    _steps(one, 0, 1, 0, 1)
    saved = one.optimizer.state_dict()
    three = zo.initialize(TinyGPT(), **_kwargs(3, "cpu", tmp_path))
    before = three.full_state_dict()
    with pytest.raises(ValueError, match="save_checkpoint"):
        three.optimizer.load_state_dict(saved)
    plain = torch.optim.AdamW(TinyGPT().parameters())
    with pytest.raises(ValueError, match="not a state dict of a zero_offload"):
        three.optimizer.load_state_dict(plain.state_dict())
    after = three.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was changed
    assert three.optimizer_steps == 0
    one.close()
    three.close()


@pytest.mark.parametrize("stage,limit", [(1, None), (3, 128 << 10)])  # 128 KiB: grads on NVMe
def test_round_trip_with_frozen_parameters(tmp_path, stage, limit):
    """Frozen parameters have no optimizer state (as with torch): the state dict covers the
    trainable ones, and the engine it is loaded into keeps its own frozen values."""

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*(torch.nn.Linear(96, 96) for _ in range(4)))
        m[0].requires_grad_(False)
        m[2].weight.requires_grad_(False)
        return m

    def run(engine, start, end):
        for i in range(start, end):
            x = torch.randn(8, 96, generator=torch.Generator().manual_seed(i))
            engine.backward(engine(x).square().mean())
            assert engine.step()

    kw = dict(
        stage=stage,
        lr=1e-2,
        offload_optimizer="nvme",
        nvme_path=tmp_path,
        host_memory_limit=limit,
        sub_group_size=4096,
    )
    a = zo.initialize(model(), **kw)
    run(a, 0, 2)
    saved = a.optimizer.state_dict()
    run(a, 2, 4)
    straight = a.full_state_dict()
    a.close()
    b = zo.initialize(model(), **kw)
    b.optimizer.load_state_dict(saved)
    run(b, 2, 4)
    resumed = b.full_state_dict()
    b.close()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


@pytest.mark.parametrize("moments", ["fp32", "8bit"])
def test_round_trip_keeps_each_parameters_own_step_count(tmp_path, moments):
    """A parameter without a gradient in an update is not stepped, so its Adam step count
    lags the others'; the state dict carries those counts, and the engine it is loaded into
    steps that parameter with its own bias correction, as the one that never stopped."""

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.trunk = torch.nn.Linear(16, 8)
            self.side = torch.nn.Linear(16, 8)
            self.use_side = True

        def forward(self, x):
            return self.trunk(x) + (self.side(x) if self.use_side else 0)

    def run(engine, start, end):
        for i in range(start, end):
            engine.module.use_side = i != 1  # no gradient for `side` in update 1
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
            engine.backward(engine(x).square().mean())
            assert engine.step()

    kw = dict(stage=2, lr=1e-2, moment_precision=moments)
    a = zo.initialize(Branchy(), **kw)
    run(a, 0, 3)
    saved = copy.deepcopy(a.optimizer.state_dict())
    run(a, 3, 5)
    straight = a.full_state_dict()
    a.close()
    b = zo.initialize(Branchy(), **kw)
    b.optimizer.load_state_dict(saved)
    run(b, 3, 5)
    resumed = b.full_state_dict()
    b.close()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
