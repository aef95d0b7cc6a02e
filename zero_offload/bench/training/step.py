"""``zero-offload bench step``: one training step of a GPT-style model through the engine.

What it answers: where the time of a step goes (forward + backward, optimizer step), and, with
the optimizer on NVMe, whether the sub-group pipeline hides I/O behind Adam (or the reverse):
read, compute and write time of the optimizer phase from the updater's ``StepTimings``, the
overlap efficiency ``max(read + write, compute) / wall``, and the NVMe traffic in GB/s next to
raw direct I/O on the same directory measured in the same run (so a ratio, not a number that
drifts with the host). With several ``--prefetch-depth`` values it sweeps stage 3's prefetch
depth and compares each with stage 3 with parameters resident (``offload_param="none"``).
With ``--optimizer-fraction 0,0.5,1`` it sweeps the share of the optimizer state kept in files
(``offload_optimizer_fraction``; the rest stays in host memory) and reports step time and the
disk bytes of the optimizer step per point; ``--rounds`` repeats the sweep with the points
interleaved (A B C A B C), so that a host's drifting load is spread over every point.
``--overlap-step both`` runs each configuration with the optimizer update after the step and
with it under the next forward (``overlap_step``), interleaved, and reports the step-time
ratio: how much of the optimizer phase the forward hides. With ``overlap_step`` a step's
update ends in the next forward, so a step's time is forward + backward + ``step()`` in the
steady state, and its optimizer timings are read once the next backward has waited for them.
The engine's ``step_during_backward`` is off here, so that the whole update is what is timed.

Why this shape: every configuration gets a fresh model and engine (no state carried over),
warm-up steps first (the first step pays for first-touch page faults and the recorded module
order), medians over the timed steps. The page cache is never measured: the swap engine uses
O_DIRECT and a ``--nvme-path`` on a memory filesystem is refused (``bench io``'s check).

Run: ``python -m zero_offload.bench.training.step --offload-optimizer nvme --nvme-path DIR
[--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from ...config import build_config
from ...planning.estimate.state import FP32_STATE, state_bytes
from ...progress import clear_status, show_status
from ...quantities import parse_count, parse_size
from ..gpt import GPTConfig
from ..micro.io import MEMORY_FILESYSTEMS, check_path, disk_baseline, fs_type
from .step_report import (
    REFERENCE_DEPTH,
    depth_sweep,
    fraction_sweep,
    overlap_ratios,
    print_tables,
)
from .step_run import DTYPES, RunResult, engine_kwargs, run_one

DEFAULT_PARAMS = 300_000_000
"""3.6 GB of fp32 master + m + v: the NVMe optimizer phase reads and writes a few GB."""
DEFAULT_VOCAB, DEFAULT_SEQ, HEAD_DIM = 8192, 128, 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zero-offload bench step``."""
    size = parser.add_argument_group("model (GPT-style; --params picks layers and width)")
    size.add_argument(
        "--params",
        type=parse_count,
        default=None,
        help=f"approximate parameter count (default {DEFAULT_PARAMS:.0e})",
    )
    size.add_argument("--preset", default=None, help="a GPTConfig preset (tiny, small, 1b, ...)")
    size.add_argument("--layers", type=int, default=None)
    size.add_argument("--width", type=int, default=None)
    size.add_argument(
        "--seq", type=int, default=None, help=f"sequence length (default {DEFAULT_SEQ})"
    )
    size.add_argument("--batch", type=int, default=1, help="micro-batch (default 1)")
    parser.add_argument(
        "--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage (default 3)"
    )
    parser.add_argument(
        "--offload-optimizer",
        nargs="+",
        default=["nvme"],
        choices=["none", "cpu", "nvme"],
        help="one or more; each is a separate run (default nvme)",
    )
    parser.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"])
    parser.add_argument(
        "--prefetch-depth",
        type=int,
        nargs="+",
        default=[REFERENCE_DEPTH],
        help="one or more; several sweep it and add a resident stage-3 reference",
    )
    parser.add_argument(
        "--optimizer-fraction",
        type=_fractions,
        default=None,
        help="comma-separated shares of the optimizer state on NVMe to sweep, "
        "e.g. 0,0.5,1 or auto (needs --offload-optimizer nvme)",
    )
    parser.add_argument(
        "--overlap-step",
        default="on",
        choices=["on", "off", "both"],
        help="overlap_step: the NVMe optimizer update under the next forward (default on); "
        "both: each run with and without, interleaved",
    )
    parser.add_argument(
        "--moment-precision",
        default="fp32",
        choices=["fp32", "bf16", "8bit"],
        help="moment_precision of every run: the optimizer state's moments (default fp32)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every run this many times, interleaved (default 1)",
    )
    parser.add_argument(
        "--nvme-path", type=Path, default=None, help="directory on the disk to test"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument(
        "--sub-group-size", type=int, default=None, help="params per NVMe sub-group"
    )
    parser.add_argument(
        "--host-memory-limit", type=parse_size, default=None, help="bytes of host buffers"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument(
        "--baseline-size",
        type=parse_size,
        default=2**30,
        help="bytes of raw O_DIRECT read/write baseline on --nvme-path (0: skip)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of tables"
    )


def _fractions(text: str) -> list[float | str]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]; 'auto' stays a word."""
    out: list[float | str] = []
    for part in text.split(","):
        part = part.strip()
        try:
            value: float | str = part if part == "auto" else float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a fraction (0..1) or 'auto'"
            ) from None
        if value != "auto" and not 0.0 <= float(value) <= 1.0:
            raise argparse.ArgumentTypeError(f"{part!r} is not in [0, 1]")
        out.append(value)
    return out


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The GPT shape: a preset, explicit layers/width, or the shape nearest ``--params`` with
    width ≈ 64 · layers-ish proportions (width a multiple of 128, heads of 64)."""
    seq = args.seq or DEFAULT_SEQ
    if args.preset:
        over = {
            k: v
            for k, v in (("layers", args.layers), ("width", args.width), ("seq", args.seq))
            if v
        }
        cfg = GPTConfig.preset(args.preset, **over)
        return GPTConfig(
            **{**asdict(cfg), "heads": max(1, cfg.width // HEAD_DIM) if args.width else cfg.heads}
        )
    target = DEFAULT_PARAMS if args.params is None else args.params
    if target < 1:
        raise ValueError(f"--params {target}: give a positive count (e.g. 1e6, 350M)")
    width = args.width or max(128, round((target / 0.1875) ** (1 / 3) / 128) * 128)
    per_layer = 12 * width * width + 13 * width
    layers = args.layers or max(1, round((target - (DEFAULT_VOCAB + seq) * width) / per_layer))
    return GPTConfig(
        layers=layers, width=width, heads=max(1, width // HEAD_DIM), vocab=DEFAULT_VOCAB, seq=seq
    )


def _runs_wanted(
    args: argparse.Namespace,
) -> list[tuple[str, str, int, float | str | None, bool]]:
    fractions = args.optimizer_fraction or [None]
    overlaps = {"on": [True], "off": [False], "both": [False, True]}[args.overlap_step]
    runs = [
        (opt, args.offload_param, d, f, o)
        for opt in args.offload_optimizer
        for d in args.prefetch_depth
        for f in (fractions if opt == "nvme" else [None])
        for o in overlaps
    ]
    if len(args.prefetch_depth) > 1 and args.stage == 3:  # the sweep's reference, each way
        for opt in args.offload_optimizer:
            for o in overlaps:
                if (opt, "none", REFERENCE_DEPTH, None, o) not in runs:
                    runs.append((opt, "none", REFERENCE_DEPTH, None, o))
    return runs


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 2 on unusable arguments, 1 when every run failed."""
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.rounds < 1:
        print(
            "bench step: need --steps >= 1, --warmup >= 0, --batch >= 1, --rounds >= 1",
            file=sys.stderr,
        )
        return 2
    if args.optimizer_fraction and "nvme" not in args.offload_optimizer:
        print(
            "bench step: --optimizer-fraction splits the optimizer state between host memory "
            "and NVMe: add --offload-optimizer nvme",
            file=sys.stderr,
        )
        return 2
    uses_nvme = "nvme" in args.offload_optimizer or args.offload_param == "nvme"
    if uses_nvme and args.nvme_path is None:
        print(
            "bench step: offload to nvme needs --nvme-path DIR (on the disk to test)",
            file=sys.stderr,
        )
        return 2
    wanted = _runs_wanted(args)
    try:
        cfg = model_config(args)
        for run_args in wanted:  # refused before any model is built (ConfigError: a ValueError)
            build_config(**engine_kwargs(args, *run_args))
    except ValueError as exc:
        print(f"bench step: {exc}", file=sys.stderr)
        return 2
    baseline = None
    if uses_nvme:
        args.nvme_path.mkdir(parents=True, exist_ok=True)
        fs = fs_type(args.nvme_path)
        why = (
            f"--nvme-path {args.nvme_path} is on {fs}, which lives in memory; it would not measure "
            "a disk"
            if fs in MEMORY_FILESYSTEMS
            else None
        ) or check_path(
            args.nvme_path, state_bytes(FP32_STATE, cfg.num_params) + max(args.baseline_size, 0)
        )
        if why:
            print(f"bench step: {why.replace('--path ', '--nvme-path ')}", file=sys.stderr)
            return 2
        if args.baseline_size > 0:
            gib = args.baseline_size / 2**30
            show_status(f"bench step: raw O_DIRECT baseline, {gib:.2f} GiB")
            baseline = disk_baseline(args.nvme_path, args.baseline_size)
    load_start = os.getloadavg()[0]
    partial: dict[int, RunResult] = {}
    for _ in range(args.rounds):  # interleaved: every run once per round
        for k, (opt, param, depth, fraction, overlap) in enumerate(wanted):
            if k in partial and partial[k].error:
                continue
            partial[k] = run_one(args, cfg, opt, param, depth, fraction, partial.get(k), overlap)
    results: list[RunResult] = []
    for k in range(len(wanted)):
        res = partial[k]
        if res.error:
            print(f"bench step: {res.label}: skipped, {res.error.splitlines()[0]}", file=sys.stderr)
        elif baseline and res.median["bytes_read"] > 0:
            m = res.median
            ideal = (
                m["bytes_read"] / 1e9 / baseline["read_gbps"]
                + m["bytes_written"] / 1e9 / baseline["write_gbps"]
            )
            res.io_efficiency = max(ideal, m["opt_compute_s"]) / m["opt_wall_s"]
        results.append(res)
    clear_status()
    report = {
        "model": {**asdict(cfg), "params": cfg.num_params},
        "batch": args.batch,
        "dtype": args.dtype,
        "stage": args.stage,
        "moment_precision": args.moment_precision,
        "steps": args.steps,
        "warmup": args.warmup,
        "nvme_path": os.fspath(args.nvme_path) if args.nvme_path else None,
        "sub_group_size": args.sub_group_size,
        "host_memory_limit": args.host_memory_limit,
        "device": str(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "baseline": baseline,
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "runs": [
            {
                **{k: v for k, v in asdict(r).items() if k != "samples"},
                "samples": [asdict(s) for s in r.samples],
            }
            for r in results
        ],
        "sweep": depth_sweep(results, args) if len(args.prefetch_depth) > 1 else None,
        "rounds": args.rounds,
        "fraction_sweep": fraction_sweep(results) if args.optimizer_fraction else None,
        "overlap": overlap_ratios(results) if args.overlap_step == "both" else None,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_tables(report)
    return 0 if any(not r.error for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero_offload.bench.training.step", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
