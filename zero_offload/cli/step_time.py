"""The predicted step time's options of ``zero-offload plan`` and ``zero-offload rehearse``:
the target's rates from named hardware (``--gpu rtx4090 --pcie 4 --nvme-drive
samsung-990pro``), explicit figures (``--nvme-read 6GB/s``), or short probes of this machine
(``--probe``)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..optim.policy import StatePolicy
from ..planning.estimate.activations import DecoderShape
from ..planning.search.planner import Plan
from ..planning.step_time.advice import low_precision, predict_step
from ..planning.step_time.hardware import (
    GPU_EFFICIENCY,
    GPUS,
    HOST_ADAM,
    NVME_DRIVES,
    PCIE,
    Rates,
    target_rates,
)
from ..planning.step_time.predict import StepPrediction, attention_flops, workload
from ..quantities import parse_count, parse_rate

__all__ = ["add_arguments", "rates", "wanted", "for_plan"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "predicted step time (from the rates of named hardware, given figures, or --probe)"
    )
    g.add_argument("--gpu", choices=sorted(GPUS), default=None, help="the target GPU")
    g.add_argument("--pcie", type=int, choices=sorted(PCIE), default=None, help="PCIe generation")
    g.add_argument(
        "--nvme-drive", choices=sorted(NVME_DRIVES), default=None, help="the swap disk, by name"
    )
    g.add_argument("--nvme-drives", type=int, default=1, help="drives striped per node")
    g.add_argument("--nvme-read", type=parse_rate, default=None, help="per node, e.g. 6GB/s")
    g.add_argument("--nvme-write", type=parse_rate, default=None, help="per node, e.g. 5GB/s")
    g.add_argument(
        "--tflops", type=float, default=None, help="the device's dense TFLOP/s (overrides --gpu)"
    )
    g.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="share of that peak a training step reaches (default 0.45 of a GPU's "
        "datasheet peak; with --probe, a decoder block's measured share of the GEMM, 0.75 "
        "without the model's shape)",
    )
    g.add_argument(
        "--cpu-adam",
        type=parse_count,
        default=None,
        help="CPU Adam params/s per node, e.g. 5e9 (default 5e9; `bench adam` measures it)",
    )
    g.add_argument("--interconnect", type=parse_rate, default=None, help="collective GB/s per GPU")
    g.add_argument(
        "--probe",
        action="store_true",
        help="measure this machine's rates (GEMM, CPU Adam, and the disk of --nvme PATH or "
        "--probe-disk), a few seconds",
    )
    g.add_argument("--probe-disk", type=Path, default=None, help="folder on the disk to probe")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the arguments ask for a prediction."""
    return bool(args.gpu or args.probe or args.tflops)


def rates(
    args: argparse.Namespace,
    shape: DecoderShape | None = None,
    micro_batch: tuple[int, int] | None = None,
    policy: StatePolicy | None = None,
) -> Rates:
    """The rates the arguments name, explicit figures over named or probed ones
    (ValueError: what is missing or wrong). ``shape`` and ``micro_batch``: the model's, for
    the probes (a GEMM at its MLP's matmul, a decoder block of its width on its tokens);
    ``policy``: the optimizer state the step runs, whose CPU optimizer rate the probes
    measure beside its low-precision alternative's."""
    if args.probe:
        from ..bench.micro.probe import probe

        disk = args.probe_disk or (Path(args.nvme) if getattr(args, "nvme", None) else None)
        dtype = getattr(torch, getattr(args, "dtype", "bfloat16"))
        mlp = decoder = None
        if shape is not None and micro_batch is not None:
            b, s = micro_batch
            mlp, decoder = (b * s, shape.hidden, shape.intermediate), (shape, micro_batch)
        policies = [] if policy is None else [policy, low_precision(policy)]
        states = [p for p in policies if p is not None]
        r = probe(disk, dtype=dtype, shape=mlp, decoder=decoder, policies=states).rates()
    elif args.gpu:
        r = target_rates(args.gpu, pcie=args.pcie, nvme=args.nvme_drive, drives=args.nvme_drives)
    elif args.tflops:
        gen = args.pcie or 4
        r = Rates(
            flops=args.tflops * 1e12,
            efficiency=GPU_EFFICIENCY,
            adam=HOST_ADAM,
            pcie=PCIE[gen],
            interconnect=PCIE[gen],
            source=f"{args.tflops:g} TFLOPS, PCIe {gen}",
        )
    else:
        raise ValueError("give --gpu NAME, --tflops or --probe for a predicted step time")
    return _override(r, args)


def _override(r: Rates, args: argparse.Namespace) -> Rates:
    """Explicit figures over named or probed ones."""
    kw: dict[str, Any] = {}
    if args.tflops:
        kw["flops"] = args.tflops * 1e12
    if args.efficiency is not None:
        kw["efficiency"] = args.efficiency
    if args.cpu_adam:
        kw["adam"] = float(args.cpu_adam)
    if args.nvme_read:
        kw["disk_read"] = args.nvme_read * args.nvme_drives
    if args.nvme_write:
        kw["disk_write"] = args.nvme_write * args.nvme_drives
    if args.interconnect:
        kw["interconnect"] = args.interconnect
    return replace(r, **kw) if kw else r


def for_plan(p: Plan, args: argparse.Namespace, model: Any, micro_batch: Any) -> StepPrediction:
    """The predicted step of the plan's recommendation (ValueError: why there is none)."""
    if p.choice is None:
        raise ValueError("nothing fits, so there is no step to predict")
    if not isinstance(micro_batch, tuple):
        raise ValueError("the predicted step needs the tokens of a step: give --micro-batch")
    b, s = micro_batch
    m = p.choice.measures
    shape = None if isinstance(model, int) else DecoderShape.of(model)
    work = workload(
        p.choice.estimate,
        tokens=b * s,
        checkpointing=bool(m is not None and m.checkpointing),
        attention_flops=0.0 if shape is None else attention_flops(shape, b, s),
    )
    return predict_step(work, rates(args, shape, micro_batch, work.policy))
