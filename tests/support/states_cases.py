"""The engine with other optimizer kinds and state precisions, on every rank, against
optimizers we did not write on one process (rank 0): torch's Adagrad, Lion as its paper
writes it in plain torch, and zero_offload.optim.CPUAdamW8bit (itself checked against
bitsandbytes' AdamW8bit)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import zero_offload as zo
from support.equivalence import master_step
from support.models import batch, loss_fn, make
from zero_offload.optim import CPUAdamW8bit

LR, WD, CLIP, STEPS, GLOBAL_BATCH = 1e-2, 0.1, 0.05, 5, 8
WIDE_IN, WIDE_HIDDEN = 16, 320  # 5120-element weights: quantized (>= 4096), 1.25 blocks x 16


class Lion(torch.optim.Optimizer):
    """Lion by its paper (Chen et al. 2023, Algorithm 2), in plain torch."""

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = beta1 * m + (1 - beta1) * p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def make_model(name: str) -> nn.Module:
    if name == "wide":
        return nn.Sequential(nn.Linear(WIDE_IN, WIDE_HIDDEN), nn.GELU(), nn.Linear(WIDE_HIDDEN, 8))
    return make(name)


def _batch(name: str, gen: torch.Generator):
    return batch("mlp" if name == "wide" else name, GLOBAL_BATCH, gen)


def _loss(name: str, out, y):
    return loss_fn("mlp" if name == "wide" else name, out, y)


def reference(name: str, initial: nn.Module, kind: str, clip: float | None) -> dict:
    """One process: the plain optimizer on fp32 parameters over the global batch."""
    master, compute = copy.deepcopy(initial), copy.deepcopy(initial)
    params = list(master.parameters())
    opt = {
        "lion": lambda: Lion(params, lr=LR, weight_decay=WD),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=LR, weight_decay=WD),
        "adamw8bit": lambda: CPUAdamW8bit(params, lr=LR, weight_decay=WD),
        "adamw": lambda: torch.optim.AdamW(params, lr=LR, weight_decay=WD),
    }[kind]()
    gen = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        x, y = _batch(name, gen)
        _loss(name, compute(x), y).backward()
        if clip is None:
            for pm, pc in zip(master.parameters(), compute.parameters()):
                pm.grad, pc.grad = pc.grad, None
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for pm, pc in zip(master.parameters(), compute.parameters()):
                    pc.copy_(pm)
        else:
            master_step(master, compute, opt)
    out = {k: v.float().clone() for k, v in master.state_dict().items()}
    if kind == "adamw8bit":
        names = [n for n, _ in master.named_parameters()]
        for n, p in zip(names, params):
            for key, value in opt.state_fp32(p).items():
                out[f"state.{n}.{key}"] = value.view(p.shape).clone()
    return out


def train(rank: int, world: int, name: str, clip: float | None, **kwargs):
    torch.manual_seed(0)
    model = make_model(name)
    initial = copy.deepcopy(model)
    engine = zo.initialize(model, lr=LR, weight_decay=WD, max_grad_norm=clip, **kwargs)
    gen = torch.Generator().manual_seed(1234)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for _ in range(STEPS):
        x, y = _batch(name, gen)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = _loss(name, engine(x[sl]), y[sl])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return engine, initial, losses


def moments_by_name(engine: zo.Engine) -> dict[str, torch.Tensor]:
    """World 1: each parameter's fp32 moments from ``engine.optimizer.state_dict()``."""
    (entry,) = engine.optimizer.state_dict()["state"].values()
    out = {}
    for unit in engine.units:
        if unit.frozen:
            continue
        for pname, slot in zip(unit.names, unit.layout.slots):
            lo = unit.shard_offset + slot.offset
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"state.{pname}.{key}"] = entry[key][lo : lo + slot.numel].view(slot.shape)
    return out


def run_case(rank: int, world: int, case: tuple) -> dict:
    name, ref_kind, clip, kwargs = case
    engine, initial, losses = train(rank, world, name, clip, **dict(kwargs))
    result = {"losses": losses, "params": engine.full_state_dict()}
    if world == 1 and ref_kind == "adamw8bit":
        result["moments"] = moments_by_name(engine)
    if ref_kind is not None and rank == 0:
        result["reference"] = reference(name, initial, ref_kind, clip)
    engine.close()
    return result


def run_cases(rank: int, world: int, cases: list[tuple]) -> dict:
    return {case: run_case(rank, world, case) for case in cases}
