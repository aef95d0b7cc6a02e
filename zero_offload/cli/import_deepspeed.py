"""``zero-offload import-deepspeed DIR OUT``: a DeepSpeed ZeRO checkpoint in this library's
format (then ``engine.load_checkpoint(OUT)`` at any world size and stage)."""

from __future__ import annotations

import argparse
import sys

from ..checkpoint.convert import import_deepspeed
from ..checkpoint.format import CheckpointError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory",
        help="DeepSpeed's save folder (with latest), a Trainer checkpoint-N, or global_stepN",
    )
    parser.add_argument("out", help="the zero_offload checkpoint folder to write into")
    parser.add_argument("--tag", default=None, help="which DeepSpeed tag (default: latest)")


def run(args: argparse.Namespace) -> int:
    try:
        folder = import_deepspeed(args.directory, args.out, tag=args.tag)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {folder} (load it with engine.load_checkpoint({args.out!r}))")
    return 0
