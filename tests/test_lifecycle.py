"""The engine's lifecycle: what close() leaves in the model (plain tensors with the trained
values, no hooks, initializable again), a closed engine refusing work, close() while an
exception unwinds, and engines dropped without close() freeing threads, files and memory.

Cases that crash the interpreter when they go wrong run in a subprocess: the exit code says
whether it survived."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import textwrap
import threading

import pytest
import torch
import torch.nn as nn
from support.children import run_python
from support.models import MLP, batch, loss_fn

import zero_offload as zo

TIERS = [
    dict(stage=0),
    dict(stage=1, offload_optimizer="cpu"),
    dict(stage=2, offload_optimizer="nvme"),
    dict(stage=3),
    dict(stage=3, offload_param="nvme", offload_optimizer="nvme"),
]


def _tier_id(tier: dict) -> str:
    return "-".join(map(str, tier.values()))


# Every tier in turn in one process (a process per tier spent most of its time importing
# torch): each prints "survived <tier>"; a crash ends the process and the tiers after it print
# nothing, so their tests fail with its stderr.
CLOSE_AND_REUSE = """
import copy, sys, torch, zero_offload as zo
from support.models import TinyGPT, batch, loss_fn
def steps(engine, n):
    for i in range(n):
        x, y = batch("gpt", 4, torch.Generator().manual_seed(i))
        engine.backward(loss_fn("gpt", engine(x), y)); engine.step()
def run(name, tier):
    kw = dict(tier, lr=1e-2, nvme_path=f"{{sys.argv[1]}}/{{name}}")
    torch.manual_seed(0)
    model = TinyGPT()
    engine = zo.initialize(model, **kw)
    steps(engine, 2)
    trained = engine.full_state_dict()
    engine.close()
    state = model.state_dict()
    assert set(state) == set(trained)
    for k, v in trained.items():
        assert torch.equal(state[k], v), k
        assert state[k].device.type == "cpu"
    total = sum(float(p.sum()) for p in model.parameters())
    x, _ = batch("gpt", 2, torch.Generator().manual_seed(9))
    with torch.no_grad():
        model(x)
    fresh = copy.deepcopy(model)
    again = zo.initialize(model, **kw)
    steps(again, 2)
    reference = zo.initialize(fresh, **kw)
    steps(reference, 2)
    a, b = again.full_state_dict(), reference.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], trained[k]) for k in a)  # it did train on
    again.close(); reference.close()
    print("survived", name, total, flush=True)
for name, tier in {tiers!r}:
    run(name, tier)
"""


@pytest.fixture(scope="module")
def closed_and_reused(tmp_path_factory) -> subprocess.CompletedProcess:
    tmp = tmp_path_factory.mktemp("close_and_reuse")
    return run_python(CLOSE_AND_REUSE.format(tiers=[(_tier_id(t), t) for t in TIERS]), str(tmp))


@pytest.mark.parametrize("tier", TIERS, ids=_tier_id)
def test_closed_model_holds_trained_values_and_trains_again_as_if_fresh(closed_and_reused, tier):
    """Train, close, then use the model as a fine-tune ends (state_dict, forward) and as a
    sweep goes on (initialize the same model again): the values are the ones
    full_state_dict() gave before close, and the second engine trains exactly like one built
    on a fresh copy of those values."""
    result = closed_and_reused
    survived = [
        line.split()[1] for line in result.stdout.splitlines() if line.startswith("survived")
    ]
    assert _tier_id(tier) in survived, f"exit {result.returncode}: {result.stderr[-3000:]}"
    assert result.returncode == 0, result.stderr[-3000:]


def _hook_counts(model: nn.Module) -> tuple[int, int]:
    module_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    grad_hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return module_hooks, grad_hooks


@pytest.mark.parametrize("stage", [2, 3])
def test_close_removes_every_hook(stage):
    model = MLP()
    for _ in range(2):
        engine = zo.initialize(model, stage=stage)
        installed = _hook_counts(model)
        assert installed[1] > 0
        engine.close()
        assert _hook_counts(model) == (0, 0)
    engine = zo.initialize(model, stage=stage)
    assert _hook_counts(model) == installed  # one set, not two
    engine.close()


def test_a_closed_engine_refuses_work(tmp_path):
    engine = zo.initialize(MLP(), stage=2)
    x, y = batch("mlp", 4, torch.Generator().manual_seed(0))
    loss = loss_fn("mlp", engine(x), y)
    optimizer = engine.optimizer  # e.g. held by a trainer
    engine.close()
    engine.close()  # idempotent
    for call in (
        lambda: engine(x),
        lambda: engine.backward(loss),
        engine.step,
        lambda: engine.save_checkpoint(tmp_path),
        engine.full_state_dict,
        lambda: engine.optimizer,
        optimizer.state_dict,
    ):
        with pytest.raises(RuntimeError, match="engine is closed.*initialize"):
            call()


def test_initialize_again_while_a_stage3_engine_is_open_is_a_clear_error():
    result = run_python(
        textwrap.dedent(
            """
        import torch, zero_offload as zo
        from support.models import MLP
        model = MLP()
        engine = zo.initialize(model, stage=3)
        try:
            zo.initialize(model, stage=3)
        except RuntimeError as err:
            print(err)
    """
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "still open" in result.stdout and "close()" in result.stdout


def test_close_while_an_exception_unwinds_does_not_communicate(caplog):
    """Inside ``with engine:`` an error stops training: close() must not start a gather the
    other ranks may never join. Stage 3's sharded parameters go to the meta device (their
    values are gone with the shards) and the model can be initialized again from scratch."""
    torch.manual_seed(0)
    model = MLP()
    with caplog.at_level(logging.WARNING), pytest.raises(KeyError):
        with zo.initialize(model, stage=3) as engine:
            engine(torch.randn(2, 16))
            raise KeyError("stop")
    assert "without close()" in caplog.text
    assert all(p.is_meta for p in model.parameters())
    assert _hook_counts(model) == (0, 0)
    engine = zo.initialize(model, stage=3)  # reset_parameters() makes them again
    x, y = batch("mlp", 4, torch.Generator().manual_seed(0))
    engine.backward(loss_fn("mlp", engine(x), y))
    assert engine.step()
    engine.close()
    assert not any(p.is_meta for p in model.parameters())


def test_close_without_hand_back_releases_stage3_shards_without_gathering(caplog):
    """For a model too large for host memory: close(hand_back=False) after the checkpoint.
    It is a choice, not an accident: no warning that the engine ended without close()."""
    model = MLP()
    engine = zo.initialize(model, stage=3)
    with caplog.at_level(logging.WARNING):
        engine.close(hand_back=False)
    assert "without close()" not in caplog.text
    assert all(p.is_meta for p in model.parameters()) and _hook_counts(model) == (0, 0)
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    zo.initialize(model, stage=2).close(hand_back=False)  # stages 0-2: values stay
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- engines dropped without close() ---------------------------------------------------------


def _threads() -> int:
    return threading.active_count()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Wide(nn.Module):
    """About 270K parameters: an engine holds ~5 MB for it (master, moments, grads,
    params), so a leak of a few engines shows above the allocator's noise."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 512)
        self.b = nn.Linear(512, 512)
        self.c = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


DROPPED = [
    dict(stage=0),
    dict(stage=1, offload_optimizer="cpu"),
    dict(stage=2, offload_optimizer="cpu"),
    dict(stage=2, offload_optimizer="nvme"),
    dict(stage=3),
    dict(stage=3, offload_param="cpu", offload_optimizer="cpu"),
    dict(stage=3, offload_param="nvme", offload_optimizer="nvme"),
]


@pytest.mark.parametrize("tier", DROPPED, ids=lambda t: "-".join(map(str, t.values())))
def test_engines_dropped_without_close_free_threads_files_and_memory(tmp_path, tier):
    x, y = batch("mlp", 4, torch.Generator().manual_seed(0))

    def one() -> None:
        model = Wide()
        engine = zo.initialize(model, nvme_path=tmp_path, **tier)
        engine.backward(loss_fn("mlp", engine(x), y))
        engine.step()

    one()  # warm: kernel build, allocator pools, lazily started torch threads
    gc.collect()
    threads, fds, rss = _threads(), _fds(), _rss()
    for _ in range(20):
        one()
    gc.collect()
    assert _threads() == threads, [t.name for t in threading.enumerate()]
    assert _fds() <= fds
    assert list(tmp_path.iterdir()) == []  # no swap folder left behind
    engine_bytes = 20 * sum(p.numel() for p in Wide().parameters())  # ~ one engine's state
    assert _rss() - rss < 4 * engine_bytes, (_rss() - rss) / engine_bytes


@pytest.mark.parametrize("stage", [1, 3])
def test_a_layer_replaced_after_initialize_is_refused_at_the_update(stage):
    """The engine trains the parameters it took over at initialize: a layer swapped in later
    would never be stepped while step() reported updates. The update names it instead."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = zo.initialize(model, stage=stage, lr=1e-2)
    engine.backward(engine(torch.randn(4, 8)).sum())
    assert engine.step()
    model[2] = nn.Linear(16, 4)
    engine.backward(engine(torch.randn(4, 8)).sum())
    with pytest.raises(RuntimeError, match=r"\['2.weight', '2.bias'\] were added"):
        engine.step()
    engine.close()
