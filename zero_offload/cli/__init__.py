"""The ``zero-offload`` command: benchmarks, planning and rehearsal, checkpoints, configs.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, importing a module when it is used.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from pathlib import Path

# (command path, module, help)
_COMMANDS = [
    (
        ("bench", "adam"),
        "zero_offload.bench.micro.adam",
        "CPU optimizer kernels (every kind and state precision) vs torch, torchao, bitsandbytes",
    ),
    (("bench", "io"), "zero_offload.bench.micro.io", "swap file I/O vs raw direct I/O on one disk"),
    (
        ("bench", "step"),
        "zero_offload.bench.training.step",
        "one training step: I/O, Adam, overlap; prefetch-depth sweep",
    ),
    (
        ("bench", "activations"),
        "zero_offload.bench.training.activations",
        "step time and peak RSS with activation offload and the tiled loss, beside without",
    ),
    (
        ("bench", "interrupts"),
        "zero_offload.bench.interrupts",
        "SIGINT/SIGTERM and full disks at random moments of an NVMe run: saved, resumed exactly",
    ),
    (
        ("bench", "state-quality"),
        "zero_offload.bench.training.state_quality",
        "GPT training runs per optimizer-state precision: loss against fp32 AdamW",
    ),
    (("plan",), "zero_offload.cli.plan", "which stage and offload fit your model and GPUs"),
    (
        ("rehearse",),
        "zero_offload.cli.rehearse",
        "run one training step on a simulated GPU: its measured memory, and whether it fits",
    ),
    (
        ("consolidate",),
        "zero_offload.cli.consolidate",
        "one full-precision state dict from a sharded checkpoint",
    ),
    (
        ("import-deepspeed",),
        "zero_offload.cli.import_deepspeed",
        "a DeepSpeed ZeRO checkpoint (stages 1-3, any world size) as a zero_offload checkpoint",
    ),
    (
        ("export-dcp",),
        "zero_offload.cli.export_dcp",
        "a checkpoint as a torch.distributed.checkpoint folder for FSDP2 / torchtitan",
    ),
    (
        ("convert-config",),
        "zero_offload.cli.convert",
        "the zero_offload keywords equivalent to a DeepSpeed JSON config",
    ),
    (
        ("keywords",),
        "zero_offload.cli.keywords",
        "every initialize keyword with its default and meaning (docs/keywords.md)",
    ),
]


def output_problem(out: Path, *, folder: bool = False) -> str | None:
    """Why the output file (or with ``folder``, folder) ``out`` cannot be written, naming the
    fix; None when it can. Checked before any work, so a long run does not fail at the end."""
    if folder:
        if out.exists() and not out.is_dir():
            return f"{out} is a file; give a new folder's path (or remove the file)"
        return None
    if out.is_dir():
        return f"{out} is a folder; give a file path such as {out / 'model.safetensors'}"
    if not out.parent.is_dir():
        return (
            f"{out.parent} does not exist; create it (mkdir -p {out.parent}) or pick another path"
        )
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-offload", description=__doc__)
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in _COMMANDS:
        if len(path) == 2:
            if path[0] not in groups:
                group_parser = top.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = group_parser.add_subparsers(dest="subcommand", required=True)
            sub = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        else:
            sub = top.add_parser(path[0], help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)
