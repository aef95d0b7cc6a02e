"""Checkpoints and optimizer state dicts of engines with other optimizer kinds and state
precisions: train, save, train on; a new engine loads and trains the same batches."""

from __future__ import annotations

import logging

import torch

import zero_offload as zo
from support.states_cases import GLOBAL_BATCH, LR, WD, _batch, _loss, make_model

NAME = "wide"


def batches(n: int) -> list:
    gen = torch.Generator().manual_seed(1234)
    return [_batch(NAME, gen) for _ in range(n)]


def build(**kwargs) -> zo.Engine:
    torch.manual_seed(0)
    return zo.initialize(make_model(NAME), lr=LR, weight_decay=WD, dtype=torch.bfloat16, **kwargs)


def train(engine: zo.Engine, data: list, rank: int = 0, world: int = 1) -> None:
    per_rank = GLOBAL_BATCH // world
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    for x, y in data:
        engine.backward(_loss(NAME, engine(x[sl]), y[sl]))
        engine.step()


def resume(rank: int, world: int, folder: str, kwargs: tuple) -> dict:
    """Params after 3 + 2 steps straight, and after loading the checkpoint of step 3 into a
    new engine and training the same 2 steps."""
    data = batches(5)
    engine = build(**dict(kwargs))
    train(engine, data[:3], rank, world)
    engine.save_checkpoint(folder, tag="s3")
    train(engine, data[3:], rank, world)
    straight = engine.full_state_dict()
    engine.close()
    again = build(**dict(kwargs))
    again.load_checkpoint(folder, tag="s3")
    train(again, data[3:], rank, world)
    resumed = again.full_state_dict()
    again.close()
    return {"straight": straight, "resumed": resumed}


def reshard(rank: int, world: int, folder: str, kwargs: tuple) -> dict:
    """Load the checkpoint ``s3`` (saved at another world size) and report the loaded
    state, the log lines about the optimizer state, and one more step's loss."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    log = logging.getLogger("zero_offload.checkpoint.load")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    engine = build(**dict(kwargs))
    engine.load_checkpoint(folder, tag="s3")
    log.removeHandler(handler)
    (entry,) = engine.optimizer.state_dict()["state"].values()
    out = {"lines": lines, "params": engine.full_state_dict()}
    for unit in engine.units:
        for pname, slot in zip(unit.names, unit.layout.slots):
            lo = unit.shard_offset + slot.offset
            out[f"exp_avg.{pname}"] = entry["exp_avg"][lo : lo + slot.numel].clone()
    train(engine, batches(1), rank, world)
    engine.close()
    return out
