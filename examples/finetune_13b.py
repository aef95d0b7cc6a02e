"""Fine-tune the 13B GPT architecture on 4 × 24 GB GPUs with the settings the planner picks.

The script plans for the full 13B model (built on the meta device: nothing is allocated),
prints the table of every stage × offload choice, then trains with the recommended keyword
arguments. ``--scale`` shrinks the model that trains (width, layers, heads, vocabulary and
sequence scale together) while the plan stays the one for 13B, so the same settings run on a
laptop CPU in seconds.

Full size:   torchrun --nproc_per_node 4 examples/finetune_13b.py --nvme-path /mnt/nvme
Shrunk:      python examples/finetune_13b.py --scale 0.01 --steps 5
Override:    python examples/finetune_13b.py --scale 0.01 --offload-optimizer cpu

Data is a fixed synthetic batch per rank (or --text FILE, read as bytes); the loss must fall.
With ``--init meta`` (the default at full size) the weights are created unit by unit from each
module's ``reset_parameters()`` inside ``initialize``; load pretrained weights afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from train_gpt import finish, text_batch, train  # the sibling example: same data and training loop

import zero_offload as zo
from zero_offload.bench.gpt import GPT, GPTConfig, synthetic_batch
from zero_offload.cli.plan import format_plan, parse_size
from zero_offload.planning.search.planner import activation_memory

FULL = GPTConfig.preset("13b", checkpoint=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="shrink the trained model (0 < scale <= 1), e.g. 0.01",
    )
    p.add_argument("--gpus", type=int, default=4, help="GPUs to plan for (default 4)")
    p.add_argument("--gpu-memory", type=parse_size, default=parse_size("24GB"))
    p.add_argument(
        "--host-memory",
        type=parse_size,
        default=parse_size("128GB"),
        help="per node (default 128GB)",
    )
    p.add_argument(
        "--nvme-path",
        default=None,
        help="swap directory (its free space is checked); shrunk runs default to a "
        "temporary directory",
    )
    p.add_argument("--stage", type=int, default=None, help="override the plan")
    p.add_argument(
        "--offload-optimizer",
        choices=["none", "cpu", "nvme"],
        default=None,
        help="override the plan",
    )
    p.add_argument(
        "--offload-param", choices=["none", "cpu", "nvme"], default=None, help="override the plan"
    )
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: scaled 2048)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="default 1e-4 at full size, larger as the model shrinks (3e-3 at 0.01)",
    )
    p.add_argument("--text", default=None, help="train on this file's bytes (vocab 256)")
    p.add_argument(
        "--init",
        choices=["meta", "cpu"],
        default=None,
        help="build the model on the meta device (default at full size) or the CPU",
    )
    args = p.parse_args(argv)
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale}")
    return args


def scaled_config(scale: float, seq: int | None = None, vocab: int | None = None) -> GPTConfig:
    """The 13B architecture shrunk: width and layers scale linearly (width a multiple of 64,
    at least 64), heads divide the width with head size >= 32, vocabulary and sequence scale
    too. ``scale=1`` is the 13B model itself."""
    if scale >= 1:
        width, layers, heads = FULL.width, FULL.layers, FULL.heads
    else:
        width = max(64, round(FULL.width * scale / 64) * 64)
        layers = max(2, round(FULL.layers * scale))
        heads = next(h for h in range(min(FULL.heads, width // 32), 0, -1) if width % h == 0)
    return GPTConfig(
        layers=layers,
        width=width,
        heads=heads,
        vocab=vocab or max(256, round(FULL.vocab * min(scale, 1.0))),
        seq=seq or max(32, round(FULL.seq * min(scale, 1.0))),
        checkpoint=True,
    )


def make_plan(args: argparse.Namespace) -> zo.planner.Plan:
    """The plan for the full 13B model on the target GPUs (shapes only, on the meta device)."""
    with torch.device("meta"):
        full_model = GPT(FULL)
    act = activation_memory(seq=FULL.seq, batch=args.batch, width=FULL.width, layers=FULL.layers)
    return zo.plan(
        full_model,
        num_gpus=args.gpus,
        gpu_memory=args.gpu_memory,
        host_memory=args.host_memory,
        nvme_path=args.nvme_path,
        activation_bytes=act,
        prefetch_depth=args.prefetch_depth,
    )


def settings(args: argparse.Namespace, plan: zo.planner.Plan) -> dict | None:
    """The plan's keyword arguments with the command line's overrides; None: nothing to run."""
    overrides = {
        k: v
        for k, v in (
            ("stage", args.stage),
            ("offload_optimizer", args.offload_optimizer),
            ("offload_param", args.offload_param),
        )
        if v is not None
    }
    if not plan.fits and "stage" not in overrides:
        return None
    kwargs = {
        "dtype": "bfloat16",
        "prefetch_depth": args.prefetch_depth,
        **plan.kwargs,
        **overrides,
    }
    if kwargs.get("stage") != 3:
        kwargs.pop("prefetch_depth", None)
        if kwargs.get("offload_param", "none") != "none":  # only stage 3 shards params
            kwargs["offload_param"] = "none"
    # the plan's host/NVMe splits apply only where its tier is NVMe (an override may move it)
    for tier, fraction in (
        ("optimizer", "offload_optimizer_fraction"),
        ("param", "offload_param_fraction"),
    ):
        if kwargs.get(f"offload_{tier}") != "nvme":
            kwargs.pop(fraction, None)
    return kwargs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = make_plan(args)
    if rank == 0:
        print(
            format_plan(
                plan,
                f"plan for the 13B model ({FULL.num_params / 1e9:.2f}B params) "
                f"on {args.gpus} × {args.gpu_memory / 1e9:.0f} GB GPUs",
            )
        )
    kwargs = settings(args, plan)
    if kwargs is None:
        print(
            "error: nothing fits (see above); pass --stage/--offload-* to run anyway",
            file=sys.stderr,
        )
        return 1
    shrunk = args.scale < 1
    lr = args.lr if args.lr is not None else min(3e-3, 1e-4 / args.scale**0.75)
    uses_nvme = "nvme" in (kwargs.get("offload_optimizer"), kwargs.get("offload_param"))
    with contextlib.ExitStack() as stack:
        if uses_nvme and not kwargs.get("nvme_path"):
            if not shrunk:
                print(
                    "error: the plan puts training state on NVMe: pass --nvme-path DIR on a "
                    "fast local disk",
                    file=sys.stderr,
                )
                return 2
            kwargs["nvme_path"] = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="finetune_13b_")
            )
        cfg = scaled_config(args.scale, args.seq, 256 if args.text else None)
        torch.manual_seed(0)
        on_meta = (args.init or ("cpu" if shrunk else "meta")) == "meta"
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = GPT(cfg)
        if rank == 0:
            print(
                f"\ntraining {cfg.num_params / 1e6:.2f}M params (scale {args.scale}: "
                f"{cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, vocab "
                f"{cfg.vocab}, seq {cfg.seq}) with {kwargs}",
                flush=True,
            )
        engine = zo.initialize(model, lr=lr, max_grad_norm=1.0, **kwargs)
        estimate = zo.estimate_memory(  # the same arithmetic, for the model that trains
            model,
            num_gpus=engine.comm.world_size,
            stage=engine.stage,
            offload_optimizer=engine.config.offload.optimizer,
            offload_param=engine.config.offload.param,
            dtype=engine.dtype,
            prefetch_depth=args.prefetch_depth,
            device=engine.device.type,
        )
        x, y = (
            text_batch(args.text, cfg, args.batch, rank)
            if args.text
            else synthetic_batch(cfg, args.batch, torch.Generator().manual_seed(rank))
        )
        start = time.perf_counter()
        first, last = train(engine, x, y, args.steps, rank)
        if rank == 0:
            report = engine.memory_report()
            print(f"loss {first:.4f} -> {last:.4f} in {time.perf_counter() - start:.1f} s")
            print("bytes per tier (resident): ledger vs estimate")
            for tier in ("device", "host", "nvme"):
                print(
                    f"  {tier:<6} {report.total(tier) / 2**20:>10.2f} MiB  "
                    f"{estimate.resident_bytes(tier) / 2**20:>10.2f} MiB"
                )
        engine.close(hand_back=False)  # the model is not used after training here
    return finish(engine, first, last)


if __name__ == "__main__":
    sys.exit(main())
