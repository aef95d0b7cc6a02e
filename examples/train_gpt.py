"""Train a small GPT-style causal LM through the zero_offload engine.

One process:      python examples/train_gpt.py --stage 3 --steps 20
Several ranks:    torchrun --nproc_per_node 2 examples/train_gpt.py --stage 2
Offload:          python examples/train_gpt.py --stage 3 --offload-optimizer cpu

Data is a fixed synthetic batch per rank (or --text FILE, read as bytes), so the loss must fall;
the script exits non-zero if it does not.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import zero_offload as zo
from zero_offload.bench.gpt import GPT, GPTConfig, synthetic_batch

# Default learning rate per preset: one at which the loss falls from the first steps (no
# warmup here). GPT-3's values for the large sizes; "small" at tiny's 3e-3 spiked at step 4.
PRESET_LR = {"tiny": 3e-3, "small": 6e-4, "1b": 2e-4, "2.7b": 1.6e-4, "13b": 1e-4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=list(PRESET_LR), help="model size")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--width", type=int, help="override the preset's width")
    p.add_argument("--seq", type=int, help="override the preset's sequence length")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    p.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"])
    p.add_argument(
        "--nvme-path",
        default=None,
        help="swap folder for nvme offload (default: a temporary folder)",
    )
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default: the preset's, "
        + ", ".join(f"{k} {v:g}" for k, v in PRESET_LR.items())
        + ")",
    )
    p.add_argument("--text", default=None, help="train on this file's bytes (vocab 256)")
    p.add_argument("--checkpoint-activations", action="store_true")
    return p.parse_args(argv)


def text_batch(path: str, cfg: GPTConfig, batch: int, rank: int) -> tuple[torch.Tensor, ...]:
    data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
    need = batch * (cfg.seq + 1)
    if data.numel() < need * (rank + 1):
        raise SystemExit(f"{path} is too short: need {need * (rank + 1)} bytes for this batch")
    idx = data[rank * need : (rank + 1) * need].view(batch, cfg.seq + 1)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def train(
    engine: zo.Engine, x: torch.Tensor, y: torch.Tensor, steps: int, rank: int
) -> tuple[float, float]:
    """Steps on one fixed batch; a ``\\r`` progress line with loss and tokens/s."""
    tokens = x.numel() * engine.comm.world_size
    first = last = math.nan
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        last = loss.item()
        first = last if step == 1 else first
        if rank == 0:
            line = (
                f"step {step}/{steps}  loss {last:.4f}  "
                f"{tokens / (time.perf_counter() - t0):,.0f} tokens/s"
            )
            print(f"\r{line:<60}", end="\n" if step == steps else "", flush=True)
    return first, last


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    overrides = {
        k: v
        for k, v in (("layers", args.layers), ("width", args.width), ("seq", args.seq))
        if v is not None
    }
    if args.text:
        overrides["vocab"] = 256
    cfg = GPTConfig.preset(args.preset, checkpoint=args.checkpoint_activations, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg)
    with contextlib.ExitStack() as stack:
        nvme_path = args.nvme_path
        if nvme_path is None and "nvme" in (args.offload_optimizer, args.offload_param):
            nvme_path = stack.enter_context(tempfile.TemporaryDirectory(prefix="train_gpt_"))
        lr = args.lr if args.lr is not None else PRESET_LR[args.preset]
        engine = zo.initialize(
            model,
            stage=args.stage,
            lr=lr,
            dtype=args.dtype,
            offload_optimizer=args.offload_optimizer,
            offload_param=args.offload_param,
            nvme_path=nvme_path,
            prefetch_depth=args.prefetch_depth,
            max_grad_norm=1.0,
        )
        return run(engine, args, cfg, rank)


def run(engine: zo.Engine, args: argparse.Namespace, cfg: GPTConfig, rank: int) -> int:
    """Train, report, and close the engine (before its swap folder goes)."""
    if args.text:
        x, y = text_batch(args.text, cfg, args.batch, rank)
    else:
        x, y = synthetic_batch(cfg, args.batch, torch.Generator().manual_seed(rank))
    start = time.perf_counter()
    first, last = train(engine, x, y, args.steps, rank)
    if rank == 0:
        elapsed = time.perf_counter() - start
        print(
            f"{cfg.num_params / 1e6:.1f}M params, stage {args.stage}, "
            f"offload optimizer={args.offload_optimizer} param={args.offload_param}: "
            f"loss {first:.4f} -> {last:.4f} in {elapsed:.1f} s"
        )
        print(engine.memory_report())
    return finish(engine, first, last)


def finish(engine: zo.Engine, first: float, last: float) -> int:
    """Release the engine, leave the process group and say whether training worked (exit
    status). Closing first means no collective or worker thread is left when gloo shuts down."""
    engine.close()
    if dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while another still talks
        dist.destroy_process_group()
    if not last < first:
        print("error: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
