"""``zero-offload export-dcp DIR OUT``: a checkpoint (this library's or DeepSpeed's) as a
``torch.distributed.checkpoint`` folder laid out like FSDP2's ``get_state_dict``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checkpoint.dcp_export import export_dcp
from ..checkpoint.format import CheckpointError
from . import output_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="a zero_offload or DeepSpeed checkpoint folder")
    parser.add_argument("out", help="the DCP folder to write")
    parser.add_argument("--tag", default=None, help="which checkpoint (default: latest)")
    parser.add_argument(
        "--model-key",
        default="model",
        help="top-level key of the parameters (default: model; '' puts them at the top, as "
        "torchtitan does)",
    )
    parser.add_argument(
        "--optim-key",
        default="optim",
        help="top-level key of the optimizer state (default: optim; torchtitan: optimizer)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        if problem := output_problem(Path(args.out), folder=True):
            raise CheckpointError(problem)
        out = export_dcp(
            args.directory, args.out, args.tag, model_key=args.model_key, optim_key=args.optim_key
        )
    except (CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    model = f"{args.model_key!r}: msd" if args.model_key else "**msd"
    print(
        f"wrote {out}: msd, osd = get_state_dict(model, optimizer); "
        f"dcp.load({{{model}, {args.optim_key!r}: osd}}, checkpoint_id={str(out)!r})"
    )
    return 0
