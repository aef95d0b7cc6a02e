"""``zero-offload plan``: which stage and offload fit a model on your GPUs, as a table.

    zero-offload plan --params 13e9 --gpus 4 --gpu-memory 24GB --host-memory 128GB [--nvme PATH]
    zero-offload plan --params 13e9 --trainable-params 50e6 ...   # LoRA: 50M params train
    zero-offload plan --model llama-13b --gpus 4 --gpu-memory 24GB --micro-batch 1x32768

With a micro-batch (``--micro-batch SEQUENCESxTOKENS``, or ``--seq-len`` with a number of
sequences) and a model whose activations it can size (``--model``: a Llama-kind Hugging Face
config, built on the meta device; ``--preset``), the planner also picks activation
checkpointing, the tiled loss and activation offload where the activations decide the fit.

Sizes and counts are read by :mod:`zero_offload.quantities` (24GB = 24e9 bytes, 24GiB = 24G =
24 × 2^30; 13e9 = 13B parameters).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

import torch

from ..memory.sizes import describe_params
from ..planning.search.planner import Plan, plan
from ..quantities import parse_count, parse_size
from . import step_time
from .states import add_state_arguments

__all__ = [
    "add_arguments",
    "run",
    "format_plan",
    "parse_micro_batch",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=parse_count, help="parameter count, e.g. 13e9 or 13B")
    model.add_argument(
        "--model",
        help="llama-7b, llama-13b, llama-70b, or a folder with a Hugging Face config.json "
        "(built on the meta device: no weights are read; needs transformers)",
    )
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
    parser.add_argument(
        "--host-memory",
        type=parse_size,
        default=None,
        help="per node (default: not checked, as if there were always enough)",
    )
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
        help="activations per GPU, as measured (default: computed from --micro-batch, "
        "else left out of the fit)",
    )
    parser.add_argument(
        "--micro-batch",
        type=_micro_batch,
        default=None,
        help="per GPU: SEQUENCESxTOKENS (e.g. 1x32768), or a number of sequences of "
        "--seq-len tokens; the planner then sizes the activations and picks the measures",
    )
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fix activation checkpointing on or off (default: the planner decides)",
    )
    parser.add_argument(
        "--offload-activations",
        choices=["none", "checkpoints"],
        default=None,
        help="fix activation offload (default: the planner decides)",
    )
    parser.add_argument(
        "--tiled-loss",
        type=int,
        default=None,
        metavar="TOKENS",
        help="fix the tiled loss, TOKENS a tile (0: the plain loss; default: the planner decides)",
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
    add_state_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    step_time.add_arguments(parser)


def parse_micro_batch(text: str) -> tuple[int, int]:
    """'1x2048' -> (1, 2048): sequences × tokens per sequence, per rank."""
    try:
        b, s = (int(v) for v in text.lower().replace("×", "x").split("x"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not SEQUENCESxTOKENS (e.g. 1x2048)") from err
    if b < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both numbers must be >= 1")
    return b, s


def _micro_batch(text: str) -> tuple[int, int | None]:
    """'1x32768' -> (1, 32768); '2' -> (2, None): the tokens come from --seq-len."""
    if text.strip().isdigit():
        if int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: sequences must be >= 1")
        return int(text), None
    return parse_micro_batch(text)


def _tokens(args: argparse.Namespace) -> tuple[int, int] | None | str:
    """The micro-batch (sequences, tokens), None, or what is wrong with the arguments."""
    mb, seq = args.micro_batch, args.seq_len
    if mb is None and seq is None:
        return None
    if mb is None:
        mb = (1, None)
    if mb[1] is not None and seq is not None and mb[1] != seq:
        return f"--micro-batch {mb[0]}x{mb[1]} and --seq-len {seq} disagree"
    tokens = mb[1] if mb[1] is not None else seq
    if tokens is None:
        return "--micro-batch SEQUENCES needs --seq-len TOKENS (or give SEQUENCESxTOKENS)"
    if tokens < 1:
        return f"--seq-len must be >= 1, got {tokens}"
    return mb[0], tokens


def _measures_column(c: Any) -> str:
    m = c.measures
    if m is None:
        return ""
    parts = ["ckpt" if m.checkpointing else "-"]
    if m.tile_tokens:
        parts.append("tiled")
    if m.offload:
        parts.append("offload")
    return "+".join(parts)


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.1f}"


def _states_table(p: Plan) -> list[str]:
    """A row per optimizer-state precision: its bytes, its least-offloaded choice that fits
    and what that choice holds."""
    taken = next((r for r in p.states if r.policy == p.policy), None)
    lines = [
        f"{'optimizer state (' + p.policy.kind.value + ')':<34}  {'B/param':>7}  "
        f"{'state GB':>8}  {'least offload that fits':<24}  {'host GB/node':>12}  "
        f"{'NVMe GB/node':>12}  {'disk GB/step/node':>17}"
    ]
    for r in p.states:
        c = r.choice
        mark = "  <- recommended" if r is taken and p.choice is not None else ""
        if c is None:
            lines.append(
                f"{r.label:<34}  {r.policy.bytes_per_param:>7.2f}  "
                f"{_gb(r.total_state_bytes):>8}  {'nothing fits':<24}"
            )
            continue
        e = c.estimate
        where = f"stage {c.stage}, {c.offload_optimizer}/{c.offload_param}"
        disk = "-" if e.nvme_fraction is None else _gb(e.ranks_per_node * e.disk_bytes_per_step)
        lines.append(
            f"{r.label:<34}  {r.policy.bytes_per_param:>7.2f}  {_gb(r.total_state_bytes):>8}  "
            f"{where:<24}  {_gb(e.host_bytes_per_node):>12}  {_gb(e.nvme_bytes_per_node):>12}  "
            f"{disk:>17}{mark}"
        )
    if not p.allow_low_precision_states and len(p.states) > 1:
        lines.append(
            "(fp32 state is recommended; --allow-low-precision-states takes a lower "
            "precision where it needs less offload)"
        )
    return lines


def format_plan(p: Plan, title: str = "") -> str:
    """The table of every stage × offload choice, the recommendation and the notes."""
    keep = 1 - p.headroom
    e0 = p.candidates[0].estimate
    sized = any(c.measures is not None for c in p.candidates)
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
        + ("not checked" if p.host_memory is None else f"{_gb(p.host_memory * keep)} GB per node")
        + f", NVMe {nvme}",
        "",
        f"{'stage':>5}  {'optimizer':<9}  {'params':<6}  {'GPU GB':>7}  "
        f"{'host GB/node':>12}  {'NVMe GB/node':>12}  {'opt on NVMe':>11}  "
        f"{'disk GB/step/node':>17}  " + (f"{'activations':<18}  " if sized else "") + "fits",
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
            + (f"{_measures_column(c):<18}  " if sized else "")
            + f"{fits}{mark}"
        )
        for reason in c.reasons:
            lines.append(f"{'':7}{reason}")
    lines += ["", *_states_table(p), ""]
    if p.choice is not None:
        lines.append("recommended: " + p.explanation)
        args = ", ".join(f"{k}={v!r}" for k, v in p.kwargs.items())
        lines.append(f"  zo.initialize(model, {args})")
        if p.choice.measures is not None and p.choice.measures.checkpointing:
            lines.append("  with activation checkpointing: model.gradient_checkpointing_enable()")
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
    tokens = _tokens(args)
    if isinstance(tokens, str):
        print(f"error: {tokens}", file=sys.stderr)
        return 2
    model: Any = args.params
    if args.preset:
        from ..bench.gpt import GPT, GPTConfig

        try:  # a sequence longer than the preset's needs position embeddings for it
            cfg = GPTConfig.preset(args.preset)
            if tokens is not None and tokens[1] > cfg.seq:
                cfg = GPTConfig.preset(args.preset, seq=tokens[1])
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        with torch.device("meta"):
            model = GPT(cfg)  # shapes only: nothing is allocated
    elif args.model:
        from ..rehearsal.models import build_model

        try:
            model = build_model(args.model)
        except (ValueError, RuntimeError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    measures: dict[str, Any] = {}
    if tokens is not None:
        mode = args.offload_activations
        measures = dict(
            micro_batch=tokens,
            checkpointing=args.checkpointing,
            offload_activations=None if mode is None else mode == "checkpoints",
            tiled_loss=args.tiled_loss,
        )
    elif (args.checkpointing, args.offload_activations, args.tiled_loss) != (None, None, None):
        print(
            "error: --checkpointing, --offload-activations and --tiled-loss size a "
            "micro-batch's activations: give --micro-batch (or --seq-len)",
            file=sys.stderr,
        )
        return 2
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
            optimizer_type=args.optimizer,
            allow_low_precision_states=args.allow_low_precision_states,
            **measures,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    step, wanted = None, step_time.wanted(args)
    try:  # the recommendation's predicted step, when rates are given and something fits
        if wanted and result.choice is not None:
            step = step_time.for_plan(result, args, model, tokens)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        print(json.dumps(out if step is None else {**out, "step_time": step.to_dict()}, indent=2))
    elif step is not None:
        print(f"{format_plan(result)}\n\n{step}")
    else:
        none = "\n\nno step time is predicted: nothing fits" if wanted else ""
        print(format_plan(result) + none)
    return 0 if result.fits else 1
