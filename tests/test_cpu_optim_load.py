"""``load_state_dict`` of the standalone CPU optimizers: a state dict of another kind or
precision is refused at the load, naming what it holds and what the optimizer keeps, with
nothing changed; torch's own Adagrad state dict continues in :class:`CPUAdagrad` as in torch."""

from __future__ import annotations

import copy

import pytest
import torch

from zero_offload.optim import CPUAdagrad, CPUAdamW8bit, CPULion8bit, CPUOptimizer

SHAPES = [(64, 80), (100,), (4500,)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(params, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _steps(opt, params, seeds) -> None:
    for seed in seeds:
        for p, g in zip(params, _grads(params, seed)):
            p.grad = g
        opt.step()


def _bf16_moments(params) -> CPUOptimizer:
    return CPUOptimizer(params, moment_precision="bf16")


def _snapshot(opt) -> tuple[list, dict]:
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}
    return groups, state


def _same(a, b) -> bool:
    (ga, sa), (gb, sb) = a, b
    if ga != gb or sa.keys() != sb.keys():
        return False
    return all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i])
        for i in sa
    )


@pytest.mark.parametrize(
    "source, target, words",
    [
        (CPULion8bit, CPUAdamW8bit, ["exp_avg_sq", "lion"]),
        (CPUAdamW8bit, CPULion8bit, ["exp_avg_sq", "lion"]),
        (CPUAdagrad, CPUOptimizer, ["sum", "adagrad"]),
        (CPUOptimizer, CPUAdamW8bit, ["exp_avg.absmax", "8bit moments"]),
        (CPUAdamW8bit, CPUOptimizer, ["exp_avg.absmax", "fp32 moments"]),
        (_bf16_moments, CPUOptimizer, ["bfloat16", "another precision"]),
    ],
    ids=[
        "lion8bit-to-adamw8bit",
        "adamw8bit-to-lion8bit",
        "adagrad-to-adamw",
        "fp32-to-8bit",
        "8bit-to-fp32",
        "bf16-to-fp32",
    ],
)
def test_another_kind_or_precision_is_refused_at_load_with_nothing_changed(
    source, target, words
) -> None:
    saved = source(_params())
    _steps(saved, saved.param_groups[0]["params"], [1, 2])
    params = _params()
    opt = target(params)
    _steps(opt, params, [3])
    before, weights = _snapshot(opt), [p.detach().clone() for p in params]
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(copy.deepcopy(saved.state_dict()))
    for w in words:
        assert w in str(err.value)
    assert _same(_snapshot(opt), before)
    _steps(opt, params, [4])  # still steps, from its own state
    assert all(not torch.equal(p, w) for p, w in zip(params, weights))


def test_torch_adagrad_state_dict_continues_in_cpu_adagrad_as_in_torch() -> None:
    ref = _params()
    torch_opt = torch.optim.Adagrad(ref, lr=0.05, lr_decay=0.01, weight_decay=0.1, eps=1e-9)
    _steps(torch_opt, ref, [1, 2, 3])
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = CPUAdagrad(ours)  # the saved hyperparameters win, as in torch
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    _steps(torch_opt, ref, [4, 5, 6])
    _steps(opt, ours, [4, 5, 6])
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(
            opt.state[q]["sum"].view_as(p), torch_opt.state[p]["sum"], rtol=2e-6, atol=0
        )
    group = opt.param_groups[0]
    assert (group["lr"], group["lr_decay"], group["eps"]) == (0.05, 0.01, 1e-9)


def test_a_maximizing_torch_state_dict_is_refused() -> None:
    torch_opt = torch.optim.Adagrad(_params(), maximize=True)
    opt = CPUAdagrad(_params())
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="maximize"):
        opt.load_state_dict(torch_opt.state_dict())
    assert _same(_snapshot(opt), before)
