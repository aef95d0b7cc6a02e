"""One process of ``zero-offload bench interrupts``: a stage-3 run with optimizer and
parameters on NVMe and the update in its overlapped and early windows, as the campaign's
trials start it (``python -m zero_offload.bench.interrupts.child SPEC``, SPEC a JSON object):
it trains, resumes, records its training state after every step, and handles Ctrl-C the way a
user's loop does or saves through ``save_on_preemption``, printing one line per event for the
campaign to read."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_child", "save_only_latest", "training_state"]


def run_child(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    import zero_offload as zo
    from zero_offload.bench.gpt import GPT, GPTConfig, synthetic_batch
    from zero_offload.errors import ZeroOffloadError

    # A shell that starts a job in the background hands it SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: a campaign started that way would deliver its
    # SIGINTs to a process that drops them. The loop below is a user's Ctrl-C loop at a
    # terminal, so it gets Python's own handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    world, rank = spec["world"], spec["rank"]
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, width=64, heads=4, vocab=256, seq=32)
    kw: dict[str, Any] = dict(
        stage=3,
        offload_optimizer="nvme",
        offload_param="nvme",
        nvme_path=spec["nvme"],
        dtype=torch.bfloat16,
        lr=1e-2,
        weight_decay=0.1,
        max_grad_norm=None,  # the pass during backward runs
        sub_group_size=4096,
        overlap_step=True,
        step_during_backward=True,
    )
    if spec["handler"] == "keyword":
        kw["save_on_preemption"] = spec["ckpt"]
    engine = zo.initialize(GPT(cfg), **kw)
    until = spec["until"]
    if spec["resume"]:
        engine.load_checkpoint(spec["ckpt"])
        print(f"resumed {engine.optimizer_steps}", flush=True)
        until = min(until, engine.optimizer_steps + 2)  # two more steps
    i = engine.optimizer_steps
    try:
        while i < until:
            x, y = synthetic_batch(cfg, 4 * world, torch.Generator().manual_seed(100 + i))
            loss = engine(x[rank::world].contiguous(), y[rank::world].contiguous())
            engine.backward(loss)
            engine.step()
            i = engine.optimizer_steps
            if spec["save_every"]:
                save_only_latest(engine, spec["ckpt"])
            if spec["record"]:
                torch.save(training_state(engine), Path(spec["record"]) / f"{i}.{rank}.pt")
            print(f"step {i}", flush=True)
    except KeyboardInterrupt:
        engine.zero_grad()
        engine.save_checkpoint(spec["ckpt"])
        print(f"saved {engine.optimizer_steps}", flush=True)
        engine.close(hand_back=False)
        return
    except ZeroOffloadError as err:
        chain, cause = [], err  # type: list[str], BaseException | None
        while cause is not None:
            chain.append(type(cause).__name__)
            cause = cause.__cause__
        print(f"error {'<-'.join(chain)}: {err}", flush=True)
        engine.close(hand_back=False)
        sys.exit(3)
    if spec["out"]:
        torch.save(training_state(engine), spec["out"] + f".{rank}")
    print(f"ended {i}", flush=True)
    engine.close(hand_back=False)


def training_state(engine: Any) -> dict[str, torch.Tensor]:
    out = {f"param.{k}": v.clone() for k, v in engine.full_state_dict().items()}
    for index, tensors in engine.optimizer.state_dict()["state"].items():
        for k, v in tensors.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{index}.{k}"] = v.clone()
    return out


def save_only_latest(engine: Any, ckpt: str) -> None:
    """Save, then drop older tags (one rank: the disk-fault runs are on one rank)."""
    path = engine.save_checkpoint(ckpt)
    for old in Path(ckpt).iterdir():
        if old.is_dir() and old.name.startswith("step") and old.name != Path(path).name:
            shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    run_child(json.loads(sys.argv[1]))
