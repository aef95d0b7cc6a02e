"""The optimizer-state arguments that ``plan`` and ``rehearse`` share (one definition)."""

from __future__ import annotations

import argparse

from ..optim.policy import MasterPrecision, MomentPrecision, OptimizerKind

__all__ = ["add_state_arguments", "state_kwargs"]


def add_state_arguments(parser: argparse.ArgumentParser, precisions: bool = False) -> None:
    """``--optimizer`` and ``--allow-low-precision-states``; with ``precisions``, also
    ``--moment-precision`` and ``--master-precision`` (a configuration to rehearse)."""
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=[k.value for k in OptimizerKind],
        help="the update rule (optimizer_type); its state precisions get a row each",
    )
    parser.add_argument(
        "--allow-low-precision-states",
        action="store_true",
        help="recommend bf16 or 8-bit optimizer state (moment_precision, master_precision) "
        "where it needs less offload than fp32 (default: fp32, the savings shown)",
    )
    if not precisions:
        return
    parser.add_argument(
        "--moment-precision",
        default=None,
        choices=[p.value for p in MomentPrecision],
        help="the optimizer's moments (moment_precision); default: the planner's choice, "
        "fp32 with --stage",
    )
    parser.add_argument(
        "--master-precision",
        default=None,
        choices=[p.value for p in MasterPrecision],
        help="the optimizer's master copy (master_precision); default: the planner's "
        "choice, fp32 with --stage",
    )


def state_kwargs(args: argparse.Namespace) -> dict[str, str]:
    """The initialize() keywords the state arguments give explicitly."""
    out = {}
    if args.optimizer != "adamw":
        out["optimizer_type"] = args.optimizer
    for key in ("moment_precision", "master_precision"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    return out
