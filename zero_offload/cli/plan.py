"""``zero-offload plan``: which stage and offload fit a model on your GPUs, as a table.

    zero-offload plan --params 13e9 --gpus 4 --gpu-memory 24GB --host-memory 128GB [--nvme PATH]
    zero-offload plan --params 13e9 --trainable-params 50e6 ...   # LoRA: 50M params train

Sizes take decimal (KB, MB, GB, TB = 1e3…1e12 bytes) or binary (KiB, MiB, GiB, TiB) units;
counts take K, M, B (or G), T suffixes or plain numbers such as 13e9.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys

import torch

from ..planning.estimate import describe_params
from ..planning.planner import Plan, plan

__all__ = ["add_arguments", "run", "format_plan", "parse_size", "parse_count"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(text: str, units: dict[str, int], what: str) -> int:
    m = _NUMBER.match(text)
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {what} (e.g. {'24GB, 24GiB' if what == 'size' else '13e9, 13B'})"
        )
    return int(float(m.group(1)) * units[m.group(2).lower()])


def parse_size(text: str) -> int:
    """'24GB' -> 24_000_000_000; '24GiB' -> 25_769_803_776; '1024' -> 1024 bytes."""
    return _parse(text, _SIZE_UNITS, "size")


def parse_count(text: str) -> int:
    """'13e9', '13B', '6.7b', '350M' -> a parameter count."""
    return _parse(text, _COUNT_UNITS, "count")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=parse_count, help="parameter count, e.g. 13e9 or 13B")
    model.add_argument(
        "--preset",
        help="a GPT preset of zero_offload.bench.gpt (1b, 2.7b, "
        "13b, ...), laid out exactly on the meta device",
    )
    parser.add_argument(
        "--trainable-params",
        type=parse_count,
        default=None,
        help="with --params: how many train, e.g. 50e6 for LoRA adapters "
        "(default: all); only they have optimizer state and gradients",
    )
    parser.add_argument("--gpus", type=int, required=True, help="data-parallel GPUs in all")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs sharing one host's memory and disk (default: min(gpus, 8))",
    )
    parser.add_argument("--gpu-memory", type=parse_size, required=True, help="per GPU, e.g. 24GB")
    parser.add_argument("--host-memory", type=parse_size, required=True, help="per node")
    nvme = parser.add_mutually_exclusive_group()
    nvme.add_argument(
        "--nvme",
        metavar="PATH",
        default=None,
        help="swap directory: its free space is measured and it becomes nvme_path",
    )
    nvme.add_argument(
        "--nvme-bytes",
        type=parse_size,
        default=None,
        help="NVMe space per node (0: none). Default: not checked",
    )
    parser.add_argument(
        "--activation-memory",
        type=parse_size,
        default=None,
        help="activations per GPU (default: left out of the fit)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument(
        "--largest-layer-params",
        type=parse_count,
        default=None,
        help="stage 3: params of the largest module (default: Ψ/50)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of each memory kept free (default 0.1)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.1f}"


def format_plan(p: Plan, title: str = "") -> str:
    """The table of every stage × offload choice, the recommendation and the notes."""
    keep = 1 - p.headroom
    e0 = p.candidates[0].estimate
    nvme = (
        "not checked"
        if p.nvme_bytes is None
        else "none"
        if p.nvme_bytes == 0
        else f"{_gb(p.nvme_bytes * keep)} GB per node"
    )
    lines = [
        title
        or (
            f"{describe_params(e0.num_params, e0.trainable_params)}, "
            f"{e0.num_gpus} GPUs "
            f"({e0.ranks_per_node} per node), {e0.dtype}"
        ),
        f"usable ({keep:.0%}): GPU {_gb(p.gpu_memory * keep)} GB each, host "
        f"{_gb(p.host_memory * keep)} GB per node, NVMe {nvme}",
        "",
        f"{'stage':>5}  {'optimizer':<9}  {'params':<6}  {'GPU GB':>7}  "
        f"{'host GB/node':>12}  {'NVMe GB/node':>12}  {'opt on NVMe':>11}  "
        f"{'disk GB/step/node':>17}  fits",
    ]
    for c in p.candidates:
        e = c.estimate
        fits = ("yes" + (" (NVMe not checked)" if c.nvme_unchecked else "")) if c.fits else "no"
        mark = "  <- recommended" if c is p.choice else ""
        share = "-" if e.nvme_fraction is None else f"{e.nvme_fraction:.0%}"
        disk = "-" if e.nvme_fraction is None else _gb(e.ranks_per_node * e.disk_bytes_per_step)
        lines.append(
            f"{c.stage:>5}  {c.offload_optimizer:<9}  {c.offload_param:<6}  "
            f"{_gb(e.gpu_bytes):>7}  {_gb(e.host_bytes_per_node):>12}  "
            f"{_gb(e.nvme_bytes_per_node):>12}  {share:>11}  {disk:>17}  "
            f"{fits}{mark}"
        )
        for reason in c.reasons:
            lines.append(f"{'':7}{reason}")
    lines.append("")
    if p.choice is not None:
        lines.append("recommended: " + p.explanation)
        args = ", ".join(f"{k}={v!r}" for k, v in p.kwargs.items())
        lines.append(f"  zo.initialize(model, {args})")
        lines.append("where each rank's bytes go:")
        for t in sorted(p.choice.estimate.terms, key=lambda t: (t.tier, -t.bytes)):
            lines.append(
                f"  {t.tier:<6}  {t.bytes / 1e9:>8.2f} GB  {t.name} [{t.phase}] ({t.formula})"
            )
    else:
        lines.append(p.explanation)
    for note in p.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.preset and args.trainable_params is not None:
        print(
            "error: --trainable-params goes with --params (every parameter of a preset trains)",
            file=sys.stderr,
        )
        return 2
    if args.preset:
        from ..bench.gpt import GPT, GPTConfig

        try:
            cfg = GPTConfig.preset(args.preset)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        with torch.device("meta"):
            model = GPT(cfg)  # shapes only: nothing is allocated
    else:
        model = args.params
    nvme_bytes = args.nvme_bytes
    if args.nvme is not None:
        try:
            nvme_bytes = shutil.disk_usage(args.nvme).free
        except OSError as exc:
            print(f"error: --nvme {args.nvme}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    try:
        result = plan(
            model,
            num_gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory=args.gpu_memory,
            host_memory=args.host_memory,
            nvme_bytes=nvme_bytes,
            nvme_path=args.nvme,
            activation_bytes=args.activation_memory,
            dtype=args.dtype,
            prefetch_depth=args.prefetch_depth,
            largest_layer_params=args.largest_layer_params,
            headroom=args.headroom,
            trainable_params=args.trainable_params,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_plan(result))
    return 0 if result.fits else 1
