"""Train a GPT-style model whose training state is far larger than this machine's RAM.

The model (default ≈ 2.6B parameters: 16 bytes each of training state, ≈ 42 GB) is built on
the meta device, materialized one unit at a time straight into NVMe files, and trained with
stage 3, parameters and optimizer state (and, under the host budget, gradients) on NVMe, in
bfloat16, on a short sequence. It prints peak RSS, the bytes on NVMe and where each step's
time went, and exits non-zero if the loss does not fall.

    python examples/beyond_memory.py --nvme-path /mnt/nvme            # ≈ 2.6B, 3 steps
    python examples/beyond_memory.py --nvme-path /tmp/zo --layers 4 --width 512 --vocab 4096

Set MALLOC_MMAP_THRESHOLD_=131072 to have glibc return large freed blocks at once, so that
peak RSS shows what the engine holds rather than what the allocator keeps for reuse. On a CPU,
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 makes the fresh gather and gradient buffers fault in
2 MiB pages, which shortens forward/backward (docs/benchmarks.md, "Huge pages on a CPU device").
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time

import psutil
import torch

import zero_offload as zo
from zero_offload.bench.gpt import GPT, GPTConfig, synthetic_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nvme-path", required=True, help="directory on a fast local disk")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=2560)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--host-memory-limit",
        type=float,
        default=2.0,
        help="GiB of host buffers the swap manager may use",
    )
    p.add_argument("--prefetch-depth", type=int, default=2)
    return p.parse_args(argv)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = GPTConfig(
        layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq
    )
    ram = psutil.virtual_memory().total
    print(
        f"model: {cfg.num_params / 1e9:.2f}B params, training state "
        f"{gib(16 * cfg.num_params)} ({16 * cfg.num_params / ram:.1f}x this machine's RAM "
        f"of {gib(ram)})",
        flush=True,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    start = time.perf_counter()
    engine = zo.initialize(
        model,
        stage=3,
        lr=args.lr,
        dtype=torch.bfloat16,
        max_grad_norm=1.0,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=args.nvme_path,
        prefetch_depth=args.prefetch_depth,
        host_memory_limit=int(args.host_memory_limit * 2**30),
    )
    print(
        f"materialized into NVMe in {time.perf_counter() - start:.1f} s; gradients on NVMe: "
        f"{engine.grads is None}",
        flush=True,
    )
    x, y = synthetic_batch(cfg, args.batch, torch.Generator().manual_seed(0))
    losses = []
    store = engine.param_store
    done: tuple[int, float, float, float] | None = None  # a step whose update may still run

    def report(step: int, fwd_bwd: float, step_s: float, param_wait: float) -> None:
        opt = engine.last_step_timings  # waits for the update if it still runs
        print(
            f"step {step}/{args.steps}  loss {losses[step - 1]:.4f}  "
            f"total {fwd_bwd + step_s:.1f} s = forward/backward {fwd_bwd:.1f} s "
            f"(of which param I/O wait {param_wait:.1f} s) + "
            f"step() {step_s:.1f} s; its update: Adam {opt.compute_s:.1f} s, disk busy "
            f"{opt.io_busy_s:.1f} s, {opt.wall_s:.1f} s from step() to its end",
            flush=True,
        )

    for step in range(1, args.steps + 1):
        wait0 = store.wait_s
        t0 = time.perf_counter()
        loss = engine(x, y)  # runs the last step's update under it (overlap_step)
        engine.backward(loss)
        t1 = time.perf_counter()
        if done is not None:
            report(*done)
        engine.step()
        t2 = time.perf_counter()
        losses.append(loss.item())
        done = (step, t1 - t0, t2 - t1, store.wait_s - wait0)
    if done is not None:
        report(*done)
    rep = engine.memory_report()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"peak RSS {gib(peak)}; on NVMe {gib(rep.total('nvme'))} "
        f"(params {gib(rep.bytes['nvme']['params'])}, grads {gib(rep.bytes['nvme']['grads'])}, "
        f"optimizer {gib(rep.bytes['nvme']['optimizer'])}); host buffers "
        f"{gib(rep.total('host'))}"
    )
    engine.close(hand_back=False)  # the model is not used after training here
    if not losses[-1] < losses[0]:
        print(
            f"error: the loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})", file=sys.stderr
        )
        return 1
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
