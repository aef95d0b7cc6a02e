"""``zero-offload bench activations``: what activation offload and the tiled loss cost a step.

A GPT-style model (``bench.gpt``) with every block under non-reentrant activation
checkpointing trains through the engine in several cases, each a fresh process (so its peak
RSS is its own), the cases interleaved round by round (A B C A B C ...) so that a host's
drifting load is spread over all of them:

- ``none``: checkpointing only;
- ``checkpoints``: + ``offload_activations=True`` (the blocks' inputs go to host buffers);
- ``all``: + ``offload_activations='all'`` (every saved tensor);
- ``tiled``: + the tiled loss (``tiled_loss``: head and cross-entropy a tile at a time);
- ``checkpoints+tiled``: both.

Per case: the median step (forward + backward + ``step()``) over the timed steps, in wall
time and in the process's CPU time (on a shared host the CPU time varies far less: it does
not count the time other processes ran), each one's ratio to ``none`` in the same round (the
median over rounds is the number to read), the peak RSS of the timed steps, the bytes
offloaded per step and the host buffers' size (the ledger).
Without a GPU the engine's device is the CPU: the copies run inline, into the same host
buffers, so the ratio is the cost of the copies themselves, with nothing to overlap them
with; on a GPU they run on side streams beside the compute.

Run: ``zero-offload bench activations [--layers 6 --width 512 --seq 1024 --batch 2]
[--cases none,checkpoints,checkpoints+tiled] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint

import zero_offload as zo

from ...activations.tiled_loss import tiled_lm_loss
from ...progress import clear_status, show_status
from ..gpt import GPT, GPTConfig, synthetic_batch
from .rss import PeakSampler

__all__ = ["add_arguments", "run", "CASES"]

CASES = ("none", "checkpoints", "all", "tiled", "checkpoints+tiled")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zero-offload bench activations``."""
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument(
        "--cases",
        default="none,checkpoints,checkpoints+tiled",
        help=f"comma-separated, of {', '.join(CASES)} (default none,checkpoints,checkpoints+tiled)",
    )
    parser.add_argument("--tile-tokens", type=int, default=1024, help="the tiled loss's tile")
    parser.add_argument(
        "--min-bytes", type=int, default=None, help="offload_activations_min_bytes (default 1 MiB)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case and round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per case")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def _gpt_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor, tile: int) -> torch.Tensor:
    """``GPT.forward``'s loss, through the tiled loss (targets already aligned)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.wte(idx) + model.wpe(pos)
    for block in model.blocks:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return tiled_lm_loss(model.ln_f(x), model.lm_head, targets, tile_tokens=tile, shift=False)


def _engine_kwargs(case: str, args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(stage=args.stage, dtype=_DTYPES[args.dtype], lr=1e-4)
    offload = case.split("+")[0]
    if offload in ("checkpoints", "all"):
        kw["offload_activations"] = offload
        if args.min_bytes is not None:
            kw["offload_activations_min_bytes"] = args.min_bytes
    return kw


def measure(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """One case in this process: ``--warmup`` then ``--steps`` timed steps."""
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        checkpoint=True,
    )
    torch.manual_seed(0)
    model: nn.Module = GPT(cfg)
    engine = zo.initialize(model, **_engine_kwargs(case, args))
    tiled = case.endswith("tiled")
    gen = torch.Generator().manual_seed(0)
    sampler = PeakSampler()
    steps, cpu, forward, backward, peaks, offloaded = [], [], [], [], [], []
    try:
        for i in range(args.warmup + args.steps):
            x, y = synthetic_batch(cfg, args.batch, gen)
            sampler.reset()
            c0 = time.process_time()
            t0 = time.perf_counter()
            if tiled:
                loss = engine.run(_gpt_loss, engine.module, x, y, args.tile_tokens)
            else:
                loss = engine(x, y)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            c3 = time.process_time()
            peak = sampler.reset()
            if i >= args.warmup:
                steps.append(t3 - t0)
                cpu.append(c3 - c0)
                forward.append(t1 - t0)
                backward.append(t2 - t1)
                peaks.append(peak)
                offloaded.append(engine.last_step.get("activations_offloaded_bytes", 0.0))
        host = engine.memory_report().bytes["host"]["activations"]
    finally:
        sampler.close()
        engine.close(hand_back=False)
    return {
        "case": case,
        "step_s": statistics.median(steps),
        "cpu_s": statistics.median(cpu),
        "forward_s": statistics.median(forward),
        "backward_s": statistics.median(backward),
        "peak_rss": max(peaks),
        "offloaded_bytes": max(offloaded),
        "host_buffer_bytes": host,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _child(case: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """``measure(case)`` in a fresh interpreter: its peak RSS is its own."""
    cmd = [sys.executable, "-m", "zero_offload.bench.training.activations", *argv, "--child", case]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(rounds: list[dict[str, dict]], cases: list[str]) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        runs = [r[case] for r in rounds]
        ratios = [r[case]["step_s"] / r[cases[0]]["step_s"] for r in rounds]
        cpu_ratios = [r[case]["cpu_s"] / r[cases[0]]["cpu_s"] for r in rounds]
        rows.append(
            {
                "case": case,
                "step_s": [r["step_s"] for r in runs],
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "cpu_s": [r["cpu_s"] for r in runs],
                "cpu_ratio": statistics.median(cpu_ratios),
                "cpu_ratios": cpu_ratios,
                "forward_s": statistics.median(r["forward_s"] for r in runs),
                "backward_s": statistics.median(r["backward_s"] for r in runs),
                "peak_rss": [r["peak_rss"] for r in runs],
                "offloaded_bytes": runs[0]["offloaded_bytes"],
                "host_buffer_bytes": runs[0]["host_buffer_bytes"],
            }
        )
    return rows


def _print(rows: list[dict[str, Any]], args: argparse.Namespace, params: int) -> None:
    gib = 2.0**30
    print(
        f"GPT {args.layers} x {args.width}, {params / 1e6:.1f}M params, {args.batch} x "
        f"{args.seq} tokens, {args.dtype}, stage {args.stage}, every block checkpointed; "
        f"{args.rounds} interleaved rounds x {args.steps} timed steps (medians)"
    )
    print(
        f"{'case':<20}{'step s (per round)':<28}{'vs none':>9}{'CPU s (per round)':>28}"
        f"{'vs none':>9}{'peak RSS GiB':>22}{'offloaded':>12}"
    )
    for r in rows:
        steps = " / ".join(f"{s:.2f}" for s in r["step_s"])
        cpu = " / ".join(f"{s:.2f}" for s in r["cpu_s"])
        peaks = " / ".join(f"{p / gib:.2f}" for p in r["peak_rss"])
        print(
            f"{r['case']:<20}{steps:<28}{r['ratio']:>8.3f}x{cpu:>28}{r['cpu_ratio']:>8.3f}x"
            f"{peaks:>22}{r['offloaded_bytes'] / 2**20:>9.1f} MiB"
        )


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    if argv is None:  # the options again, for the child processes
        argv = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("json", "child", "cases", "rounds", "_module", "command", "subcommand")
            and v is not None
        ]
    rounds: list[dict[str, dict]] = []
    for i in range(args.rounds):
        results = {}
        for case in cases:
            show_status(f"bench activations: round {i + 1}/{args.rounds}: {case}")
            results[case] = _child(case, args, argv)
        rounds.append(results)
    clear_status()
    rows = _summary(rounds, cases)
    if args.json:
        print(json.dumps({"args": argv, "rounds": rounds, "summary": rows}, indent=2))
    else:
        _print(rows, args, rounds[0][cases[0]]["params"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
