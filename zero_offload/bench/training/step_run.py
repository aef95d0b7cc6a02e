"""One configuration of ``bench step``: a fresh model and engine, its warm-up and timed steps,
and the medians of what they measured."""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import zero_offload as zo

from ...progress import show_status
from ..gpt import GPT, GPTConfig, synthetic_batch
from .high_water import HighWater

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Sample:
    """One timed step. ``opt_*`` come from the updater's ``StepTimings``; ``peak_rss``: the
    process's largest RSS from the forward's start to ``step()``'s end (None off Linux)."""

    fwd_s: float
    bwd_s: float
    fwd_bwd_s: float
    step_s: float
    total_s: float
    opt_read_s: float
    opt_write_s: float
    opt_io_busy_s: float
    opt_compute_s: float
    opt_wall_s: float
    bytes_read: int
    bytes_written: int
    overlap: float
    peak_rss: int | None


@dataclass
class RunResult:
    """One configuration: medians over its timed steps (each field separately)."""

    stage: int
    offload_optimizer: str
    offload_param: str
    prefetch_depth: int
    optimizer_fraction: float | str | None = None  # offload_optimizer_fraction (None: unset)
    overlap_step: bool = True
    error: str | None = None
    samples: list[Sample] = field(default_factory=list)
    median: dict[str, float] = field(default_factory=dict)
    nvme_gbps: float | None = None  # (read + written bytes) / optimizer wall
    peak_rss: int | None = None  # the largest of the timed steps' peak RSS, bytes
    io_efficiency: float | None = None  # raw-disk time for those bytes / optimizer wall

    @property
    def label(self) -> str:
        fraction = "" if self.optimizer_fraction is None else f" fraction={self.optimizer_fraction}"
        return (
            f"stage {self.stage} opt={self.offload_optimizer} param={self.offload_param} "
            f"depth={self.prefetch_depth}{fraction}" + ("" if self.overlap_step else " no overlap")
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_kwargs(
    args: argparse.Namespace,
    opt: str,
    param: str,
    depth: int,
    fraction: float | str | None = None,
    overlap: bool = True,
) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        stage=args.stage,
        offload_optimizer=opt,
        offload_param=param,
        prefetch_depth=depth,
        dtype=DTYPES[args.dtype],
        lr=1e-4,
        overlap_step=overlap,
        # the optimizer's reads and writes stay in the update, where their GB/s compare
        # with the raw disk's; the pass during backward is measured side by side
        # (docs/bench_step.md, "Stepping during backward")
        step_during_backward=False,
        moment_precision=args.moment_precision,
    )
    if fraction is not None:
        kw["offload_optimizer_fraction"] = fraction
    if "nvme" in (opt, param):
        kw["nvme_path"] = os.fspath(args.nvme_path)
    if args.sub_group_size:
        kw["sub_group_size"] = args.sub_group_size
    if args.host_memory_limit:
        kw["host_memory_limit"] = args.host_memory_limit
    return kw


def run_one(
    args: argparse.Namespace,
    cfg: GPTConfig,
    opt: str,
    param: str,
    depth: int,
    fraction: float | str | None = None,
    res: RunResult | None = None,
    overlap: bool = True,
) -> RunResult:
    """Fresh model + engine, ``--warmup`` then ``--steps`` timed steps; errors are recorded.
    ``res``: an earlier round's result of the same run, to add this round's samples to."""
    res = res or RunResult(args.stage, opt, param, depth, fraction, overlap_step=overlap)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    engine = None
    timed: tuple[float, float, float, int | None] | None = None  # its optimizer timings are due
    high_water = HighWater()
    try:
        engine = zo.initialize(
            GPT(cfg), **engine_kwargs(args, opt, param, depth, fraction, overlap)
        )
    except NotImplementedError as exc:
        res.error = f"not implemented yet ({exc})"
        return res
    try:
        for i in range(args.warmup + args.steps):
            show_status(
                f"bench step: {res.label}: step {i + 1}/{args.warmup + args.steps}"
                + (" (warm-up)" if i < args.warmup else "")
            )
            x, y = synthetic_batch(cfg, args.batch, gen)
            _sync(engine.device)
            high_water.reset()
            t0 = time.perf_counter()
            loss = engine(x, y)
            _sync(engine.device)
            tf = time.perf_counter()
            engine.backward(loss)  # waits for the last step's update, if it ran on
            _sync(engine.device)
            t1 = time.perf_counter()
            if timed is not None:  # the last step's optimizer timings are final now
                res.samples.append(_sample(*timed, engine.last_step_timings))
                timed = None
            engine.step()
            _sync(engine.device)
            t2 = time.perf_counter()
            value = float(loss.detach())
            if not math.isfinite(value):
                raise RuntimeError(f"loss is {value} at step {i + 1} of {res.label}")
            if i >= args.warmup:
                timed = (tf - t0, t1 - tf, t2 - t1, high_water.peak())
        if timed is not None:
            res.samples.append(_sample(*timed, engine.last_step_timings))  # waits for it
    finally:
        engine.close(hand_back=False)  # the model is dropped: no gathering it to the host
        del engine
        gc.collect()
    res.median = {
        k: statistics.median(getattr(s, k) for s in res.samples)
        for k in Sample.__dataclass_fields__
        if k != "peak_rss"
    }
    peaks = [s.peak_rss for s in res.samples if s.peak_rss is not None]
    res.peak_rss = max(peaks) if peaks else None
    m = res.median
    if m["bytes_read"] + m["bytes_written"] > 0 and m["opt_wall_s"] > 0:
        res.nvme_gbps = (m["bytes_read"] + m["bytes_written"]) / m["opt_wall_s"] / 1e9
    return res


def _sample(fwd_s: float, bwd_s: float, step_s: float, peak_rss: int | None, t: Any) -> Sample:
    """A timed step: its forward, backward and ``step()`` seconds, its peak RSS, and its
    optimizer's ``StepTimings``."""
    return Sample(
        fwd_s,
        bwd_s,
        fwd_s + bwd_s,
        step_s,
        fwd_s + bwd_s + step_s,
        t.read_s,
        t.write_s,
        t.io_busy_s,
        t.compute_s,
        t.wall_s,
        t.bytes_read,
        t.bytes_written,
        t.overlap,
        peak_rss,
    )
