"""``zero-offload consolidate DIR OUT``: one full-precision state dict from a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checkpoint.convert import consolidate_checkpoint
from ..checkpoint.format import CheckpointError
from ..checkpoint.tags import checkpoint_root
from . import output_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory",
        help="the checkpoint folder given to save_checkpoint, a Trainer checkpoint folder "
        "(checkpoint-N, holding zero_offload/), or a Trainer output_dir (its newest checkpoint-N)",
    )
    parser.add_argument("out", help="output file (safetensors when installed, else torch.save)")
    parser.add_argument("--tag", default=None, help="which checkpoint (default: latest)")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the size and checksum check of the rank files",
    )


def run(args: argparse.Namespace) -> int:
    root = checkpoint_root(Path(args.directory))
    try:
        if problem := output_problem(Path(args.out)):
            raise CheckpointError(problem)
        state = consolidate_checkpoint(root, tag=args.tag, out=args.out, verify=not args.no_verify)
    except (CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    numel = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    print(f"wrote {args.out} from {root}: {len(state)} tensors, {numel / 1e6:.1f}M values")
    return 0
