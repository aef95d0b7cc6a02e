"""Stage 3 with ranks whose forwards run different modules (per-rank routing, an early exit):
every rank raises the same clear error naming the modules, before any mismatched gather,
instead of pairing different units' all-gathers or hanging until the process group times out.
Also: stage 3 refuses to run under CUDA graph capture.

The process groups here time out after 30 s, so a hang fails the test rather than stalling it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from support.distributed import run_ranks

import zero_offload as zo
from zero_offload.params.order import DivergentForwardError

TIMEOUT = 30


class Routed(nn.Module):
    """``a`` then, per rank, ``b`` or not, then ``c``; ``stop`` ends early on chosen ranks."""

    def __init__(self, runs_b: bool, stops: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.runs_b, self.stops = runs_b, stops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.runs_b:
            h = torch.tanh(self.b(h))
        if self.stops:
            return h
        return self.c(h)


def _diverge(rank: int, world: int, skip_rank: int, stop_rank: int) -> str:
    torch.manual_seed(0)
    model = Routed(runs_b=rank != skip_rank, stops=rank == stop_rank)
    engine = zo.initialize(model, stage=3, lr=1e-2)
    try:
        engine(torch.randn(2, 8))
    except DivergentForwardError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "skip_rank, stop_rank, named",
    [
        (1, -1, ["rank 0 runs module 'b'", "rank 1 runs module 'c'"]),  # rank 1 skips b
        (-1, 1, ["rank 0 runs module 'c'", "rank 1 ended its forward"]),  # rank 1 exits early
    ],
)
def test_ranks_running_different_modules_get_one_clear_error(skip_rank, stop_rank, named):
    messages = run_ranks(2, _diverge, skip_rank, stop_rank, timeout=TIMEOUT)
    assert messages[0] == messages[1], "every rank raises the same error"
    for part in named:
        assert part in messages[0], messages[0]
    assert "same modules in the same order" in messages[0]


def _same_route(rank: int, world: int) -> list[float]:
    """Both ranks take the same data-dependent branch, which changes between steps."""
    torch.manual_seed(0)
    model = Routed(runs_b=True, stops=False)
    engine = zo.initialize(model, stage=3, lr=1e-2)
    losses = []
    for step in range(3):
        model.runs_b = step % 2 == 0
        loss = engine(torch.ones(2, 8) * (rank + 1)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    checks = engine._parts.gatherer.order.checks
    engine.close()
    return [checks, *losses]


@pytest.mark.multiprocess
def test_ranks_that_agree_train_through_changes_of_route():
    res = run_ranks(2, _same_route, timeout=TIMEOUT)
    assert res[0][0] == res[1][0] > 0  # every gather point was checked, on both ranks


def test_stage3_refuses_cuda_graph_capture(monkeypatch):
    engine = zo.initialize(Routed(runs_b=True, stops=False), stage=3, lr=1e-2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        engine(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        engine.module(torch.randn(2, 8))  # a module called directly, outside the engine
    monkeypatch.undo()
    engine.backward(engine(torch.randn(2, 8)).sum())  # the failed calls left nothing behind
    engine.step()
    engine.close()
