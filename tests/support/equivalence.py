"""The equivalence worker: train with the engine on every rank and compare with single-process
torch.optim.AdamW on the same global batch (run on rank 0)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

import zero_offload as zo
from support.models import batch, loss_fn, make

LR, WD, CLIP, STEPS, GLOBAL_BATCH = 1e-2, 0.1, 0.05, 5, 8


@dataclass
class CaseResult:
    max_diff_lr: float = 0.0  # max |engine - reference| / lr
    mean_diff: float = 0.0
    params: int = 0  # Ψ
    flat_shard: int = 0  # this rank's flat shard elements (S)
    largest_unit_bytes: int = 0
    units: int = 0
    report: object = None
    clipped: bool = False
    extra: dict = field(default_factory=dict)


def reference(
    model: torch.nn.Module, name: str, dtype: torch.dtype, steps: int, gas: int = 1
) -> dict[str, torch.Tensor]:
    """Single process: AdamW on fp32 master weights; compute in ``dtype``."""
    compute = copy.deepcopy(model).to(dtype)
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        for _ in range(gas):
            x, y = batch(name, GLOBAL_BATCH, gen)
            x = x.to(dtype) if x.is_floating_point() else x
            (loss_fn(name, compute(x), y) / gas).backward()
        master_step(master, compute, opt)
    return {k: v.float() for k, v in master.state_dict().items()}


def master_step(
    master: torch.nn.Module, compute: torch.nn.Module, opt: torch.optim.Optimizer
) -> None:
    """Mixed precision the plain way: the compute copy's gradients (None for frozen
    parameters) go to the fp32 master, which is clipped and stepped and copied back."""
    for pm, pc in zip(master.parameters(), compute.parameters()):
        pm.grad = None if pc.grad is None else pc.grad.float()
        pc.grad = None
    torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for pm, pc in zip(master.parameters(), compute.parameters()):
            pc.copy_(pm)


def train(
    rank: int, world: int, name: str, dtype: torch.dtype, steps: int, gas: int = 1, **kwargs
) -> tuple[zo.Engine, torch.nn.Module]:
    torch.manual_seed(0)
    model = make(name)
    initial = copy.deepcopy(model)
    engine = zo.initialize(
        model,
        lr=LR,
        weight_decay=WD,
        max_grad_norm=CLIP,
        dtype=dtype,
        gradient_accumulation_steps=gas,
        **kwargs,
    )
    gen = torch.Generator().manual_seed(1234)
    per_rank = GLOBAL_BATCH // world
    for _ in range(steps):
        for _ in range(gas):
            x, y = batch(name, GLOBAL_BATCH, gen)
            sl = slice(rank * per_rank, (rank + 1) * per_rank)
            loss = loss_fn(name, engine(x[sl]), y[sl])
            engine.backward(loss)
            engine.step()
    return engine, initial


def training_state(engine: zo.Engine) -> dict[str, torch.Tensor]:
    """A copy of everything training changes: full parameters and optimizer state."""
    out = {f"param.{k}": v.clone() for k, v in engine.full_state_dict().items()}
    for index, tensors in engine.optimizer.state_dict()["state"].items():
        for k, v in tensors.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{index}.{k}"] = v.clone()
    return out


def assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def compare(engine_sd: dict, ref_sd: dict) -> tuple[float, float]:
    diffs = [(engine_sd[k] - ref_sd[k]).abs().flatten() for k in ref_sd]
    d = torch.cat(diffs)
    return d.max().item() / LR, d.mean().item()


def run_case(
    rank: int, world: int, name: str, dtype: torch.dtype, stage: int, gas: int = 1, **kwargs
) -> CaseResult:
    engine, initial = train(rank, world, name, dtype, STEPS, gas=gas, stage=stage, **kwargs)
    sd = engine.full_state_dict()
    res = CaseResult()
    res.params = sum(p.numel() for p in initial.parameters())
    res.flat_shard = engine.shard_numel
    res.largest_unit_bytes = max(u.full_bytes for u in engine.units)
    res.units = len(engine.units)
    res.report = engine.memory_report()
    res.clipped = engine.last_grad_norm is not None and engine.last_grad_norm > CLIP
    if rank == 0:
        ref = reference(initial, name, dtype, STEPS, gas=gas)
        res.max_diff_lr, res.mean_diff = compare(sd, ref)
    return res


def run_matrix(rank: int, world: int, cases: list[tuple]) -> dict:
    out = {}
    for case in cases:
        name, dtype_name, stage, kwargs = case
        dtype = getattr(torch, dtype_name)
        out[(name, dtype_name, stage, tuple(sorted(kwargs.items())))] = run_case(
            rank, world, name, dtype, stage, **kwargs
        )
    return out
