"""``zero-offload rehearse``: will this model, micro-batch and configuration fit these GPUs?

    zero-offload rehearse --model llama-13b --gpus 4 --gpu-memory 24GB --host-memory 256GB \\
        --micro-batch 1x2048 --checkpointing

Without ``--stage`` the configuration is the one ``zero-offload plan`` recommends for the
model and GPUs (with its rough activation figure; NVMe only with ``--nvme-bytes``); the
rehearsal then runs rank 0's ``initialize``, forward, backward and step on a simulated GPU
and prints what each phase allocated, beside the planner's figures, with a verdict. Exit
status: 0 fits, 1 does not fit (or is not device-clean, or failed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..planning.estimate.memory import activation_memory
from ..quantities import parse_size
from ..rehearsal.attention import KERNELS
from . import step_time
from .plan import parse_micro_batch
from .states import add_state_arguments, state_kwargs

__all__ = ["add_arguments", "run", "parse_micro_batch"]


def _value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="llama-7b, llama-13b, llama-70b, or a folder with a Hugging Face "
        "config.json (built on the meta device: no weights are read)",
    )
    parser.add_argument("--gpus", type=int, required=True, help="data-parallel ranks in all")
    parser.add_argument("--gpu-memory", type=parse_size, required=True, help="per GPU, e.g. 24GB")
    parser.add_argument(
        "--host-memory",
        type=parse_size,
        default=None,
        help="per node (default: not a limit: the planner and the simulated host assume "
        "enough, and the report says how much was used)",
    )
    parser.add_argument(
        "--micro-batch",
        type=parse_micro_batch,
        default=(1, 2048),
        help="sequences x tokens per rank (default 1x2048)",
    )
    parser.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="activation checkpointing (the model recomputes its layers); without --stage "
        "the planner decides unless this or --no-checkpointing is given",
    )
    parser.add_argument(
        "--offload-activations",
        choices=["none", "checkpoints", "all"],
        default=None,
        help="activation offload: the checkpointed inputs (checkpoints) or every saved "
        "tensor (all) to host memory; without --stage the planner decides unless given",
    )
    parser.add_argument(
        "--tiled-loss",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the LM head and loss TOKENS tokens at a time (0: the plain loss); without "
        "--stage the planner decides unless given",
    )
    parser.add_argument(
        "--attention",
        choices=KERNELS,
        default="auto",
        help="how scaled_dot_product_attention is counted: auto (default), the kernel a "
        "GPU picks (flash / memory-efficient: no s^2 scores); math, the math path "
        "(s^2 scores kept); flash or efficient to force one; eager, a named model's "
        "eager attention code",
    )
    parser.add_argument(
        "--stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="default: what zero-offload plan recommends",
    )
    parser.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default=None)
    parser.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default=None)
    parser.add_argument(
        "--nvme-bytes",
        type=parse_size,
        default=None,
        help="NVMe space per node on the target machine (e.g. 2TB): the "
        "planner may then choose NVMe, and the simulated disk holds this "
        "much; the NVMe tier is simulated (sizes only, nothing written)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prefetch-depth", type=int, default=None)
    parser.add_argument(
        "--set",
        type=_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other initialize() keyword, e.g. --set prefetch_bytes=1e9",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=2,
        help="forward/backward/step rounds (the second has stage 3's prefetching on; default 2)",
    )
    parser.add_argument(
        "--headroom", type=float, default=0.1, help="fraction of GPU memory kept free (default 0.1)"
    )
    add_state_arguments(parser, precisions=True)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    step_time.add_arguments(parser)


_ENOUGH_HOST = 1 << 50  # no --host-memory: host memory is not what decides the fit


def _recommended(args: argparse.Namespace, model: Any) -> Any:
    """The planner's plan for this model, these GPUs and this micro-batch (its activation
    measures where it can size the model's activations), or why there is none."""
    from ..planning.estimate.activations import DecoderShape
    from ..planning.search.planner import plan

    sized = DecoderShape.of(model) is not None
    measures: dict[str, Any] = {}
    if sized:
        mode = args.offload_activations
        if mode == "all":
            return "the planner does not size --offload-activations all: give --stage too"
        measures = dict(
            micro_batch=args.micro_batch,
            checkpointing=args.checkpointing,
            offload_activations=None if mode is None else mode == "checkpoints",
            tiled_loss=args.tiled_loss,
        )
    else:  # a model whose activations the planner cannot size: the rough rule
        cfg = getattr(model, "config", None)
        if cfg is not None and hasattr(cfg, "hidden_size"):
            b, s = args.micro_batch
            measures["activation_bytes"] = activation_memory(
                seq=s,
                batch=b,
                width=cfg.hidden_size,
                layers=cfg.num_hidden_layers,
                dtype=args.dtype,
                checkpointing=bool(args.checkpointing),
            )
    p = plan(
        model,
        num_gpus=args.gpus,
        gpu_memory=args.gpu_memory,
        host_memory=args.host_memory,
        nvme_bytes=args.nvme_bytes or 0,
        dtype=args.dtype,
        headroom=args.headroom,
        optimizer_type=args.optimizer,
        allow_low_precision_states=args.allow_low_precision_states,
        moment_precision=args.moment_precision,
        master_precision=args.master_precision,
        fp32_moment_params=dict(args.set).get("fp32_moment_params", ()),
        **measures,
        **({} if args.prefetch_depth is None else {"prefetch_depth": args.prefetch_depth}),
    )
    if not p.fits:
        return (
            "the planner finds nothing that fits"
            + ("" if args.nvme_bytes else " without NVMe (give --nvme-bytes)")
            + ":\n"
            + p.explanation
        )
    return p


def run(args: argparse.Namespace) -> int:
    from ..rehearsal.models import build_model
    from ..rehearsal.run import rehearse

    checkpointing = bool(args.checkpointing)
    planner = ""
    if args.stage is None:
        try:
            p = _recommended(args, build_model(args.model, attention=args.attention))
        except (ValueError, RuntimeError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if isinstance(p, str):
            print(f"error: {p}", file=sys.stderr)
            return 2
        kwargs = dict(p.kwargs)
        if p.choice is not None and p.choice.measures is not None:
            checkpointing = p.choice.measures.checkpointing
        planner = p.explanation
        print(f"planner's recommendation: {kwargs}", file=sys.stderr)
    else:
        kwargs = {"stage": args.stage, "dtype": args.dtype}
        for key in ("offload_optimizer", "offload_param", "prefetch_depth"):
            if getattr(args, key) is not None:
                kwargs[key] = getattr(args, key)
        if args.offload_activations is not None:
            kwargs["offload_activations"] = args.offload_activations
        if args.tiled_loss is not None:
            kwargs["tiled_loss"] = args.tiled_loss
    kwargs.update(state_kwargs(args))  # given precisions override the planner's
    kwargs.update(dict(args.set))
    # the node's disk is shared by its ranks (as the planner counts it)
    nvme_per_rank = (
        None if args.nvme_bytes is None else args.nvme_bytes // max(1, min(args.gpus, 8))
    )
    try:
        result = rehearse(
            args.model,
            world_size=args.gpus,
            gpu_memory=args.gpu_memory,
            micro_batch=args.micro_batch,
            checkpointing=checkpointing,
            attention=args.attention,
            iterations=args.iterations,
            headroom=args.headroom,
            host_memory=args.host_memory or _ENOUGH_HOST,
            nvme_bytes=nvme_per_rank,
            planner=planner,
            **kwargs,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # the predicted step from the rehearsal's counts, when rates are given
        step = _predicted(result, args) if step_time.wanted(args) else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        print(json.dumps(out if step is None else {**out, "step_time": step.to_dict()}, indent=2))
    else:
        print(str(result) + ("" if step is None else f"\n\n{step}"))
    return 0 if result.fits else 1


def _predicted(result: Any, args: argparse.Namespace) -> Any:
    from ..planning.estimate.activations import DecoderShape
    from ..rehearsal.models import build_model
    from ..rehearsal.step_time import predicted_step

    shape = None
    if args.probe:  # the probes run the model's shapes
        shape = DecoderShape.of(build_model(args.model, attention=args.attention))
    rates = step_time.rates(args, shape, result.micro_batch, result.estimate.policy)
    return predicted_step(result, rates)
