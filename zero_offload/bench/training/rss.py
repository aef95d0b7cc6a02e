"""``python -m zero_offload.bench.training.rss``: where a rank's resident memory goes, term by term.

Builds a GPT on the meta device, initializes it (stage 3 by default, params and optimizer on
NVMe, default budget) and prints, after ``initialize`` and after each step: RSS, the memory
ledger's host terms (``engine.memory_report()``), what glibc's allocator holds (in use, and
free but kept for reuse), and the engine's own mapped buffers. The peak during ``initialize``
and during training is sampled by a thread. RSS does not depend on the machine's load, so the
numbers hold on a shared host where timings would not.

Run: ``python -m zero_offload.bench.training.rss --params 2e8 --nvme-path DIR [--steps 6]
[--json]``.

``--ranks N`` runs N gloo ranks on this node (``LOCAL_WORLD_SIZE=N``, as ``torchrun`` sets it)
with their default budgets, and adds up their peak RSS against the node's budget
(``DEFAULT_HOST_FRACTION`` of the available memory): what several ranks on one node hold.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zero_offload as zo

from ...quantities import parse_size
from ...swap.budget import DEFAULT_HOST_FRACTION
from ..gpt import GPT, synthetic_batch
from .step import DEFAULT_VOCAB, HEAD_DIM, model_config

__all__ = ["PeakSampler", "malloc_stats", "main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_stats() -> dict[str, int] | None:
    """glibc's view (``mallinfo2``): bytes in use from the heap arenas, in large mmapped
    chunks, and free in the arenas but not returned to the system. None off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return {"arena_in_use": m.uordblks, "mmapped_in_use": m.hblkhd, "arena_free": m.fordblks}


def rss() -> int:
    return psutil.Process().memory_info().rss


class PeakSampler:
    """Largest RSS seen by a thread sampling every ``interval`` seconds between ``reset`` calls
    (``ru_maxrss`` only grows, so it cannot tell one phase's peak from an earlier one's)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self._peak = rss()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="zo-rss-sampler")
        self._thread.start()

    def _run(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(self.interval):
            value = proc.memory_info().rss
            with self._lock:
                self._peak = max(self._peak, value)

    def reset(self) -> int:
        """The peak since the last reset (including now); starts a new phase."""
        now = rss()
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        return peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Row:
    when: str
    rss: int
    peak: int
    ledger_host: dict[str, int]
    malloc: dict[str, int] | None


def _row(when: str, engine: Any, peak: int) -> Row:
    rep = engine.memory_report()
    return Row(when, rss(), peak, dict(rep.bytes["host"]), malloc_stats())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=float, default=2e8, help="approximate parameter count")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    p.add_argument("--offload-optimizer", default="nvme", choices=["cpu", "nvme"])
    p.add_argument("--offload-param", default="nvme", choices=["none", "cpu", "nvme"])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--host-memory-limit", type=parse_size, default=None)
    p.add_argument("--sub-group-size", type=int, default=None)
    p.add_argument("--nvme-path", type=Path, required=True)
    p.add_argument(
        "--ranks", type=int, default=1, help="gloo ranks on this node (default 1: this process)"
    )
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _rank(rank: int, args: argparse.Namespace, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks
    )
    try:
        result = measure(args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def measure_ranks(args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` on ``args.ranks`` spawned ranks of one node; their results, the sum of
    their peaks (an upper bound of the node's peak) and the node's default budget."""
    import tempfile

    node_budget = int(psutil.virtual_memory().available * DEFAULT_HOST_FRACTION)
    os.environ["LOCAL_WORLD_SIZE"] = str(args.ranks)  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank,
            args=(args, os.path.join(tmp, "init"), tmp),
            nprocs=args.ranks,
            join=True,
            start_method="spawn",
        )
        ranks = []
        for r in range(args.ranks):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    peaks = [max(row["peak"] for row in res["rows"]) for res in ranks]
    return {"ranks": ranks, "peaks": peaks, "sum_of_peaks": sum(peaks), "node_budget": node_budget}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    ns = argparse.Namespace(
        params=args.params, preset=None, layers=args.layers, width=args.width, seq=args.seq
    )
    cfg = model_config(ns)
    kw: dict[str, Any] = dict(
        stage=args.stage,
        offload_optimizer=args.offload_optimizer,
        offload_param=args.offload_param if args.stage == 3 else "none",
        dtype=_DTYPES[args.dtype],
        lr=1e-4,
        nvme_path=os.fspath(args.nvme_path),
    )
    if args.host_memory_limit:
        kw["host_memory_limit"] = args.host_memory_limit
    if args.sub_group_size:
        kw["sub_group_size"] = args.sub_group_size
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    before = rss()
    with torch.device("meta"):
        model = GPT(cfg)
    sampler = PeakSampler()
    rows: list[Row] = []
    engine = zo.initialize(model, **kw)
    try:
        rows.append(_row("initialize", engine, sampler.reset()))
        gen = torch.Generator().manual_seed(0)
        for step in range(args.steps):
            x, y = synthetic_batch(cfg, args.batch, gen)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            rows.append(_row(f"step {step}", engine, sampler.reset()))
    finally:
        sampler.close()
        engine.close()
    return {
        "model": {
            "layers": cfg.layers,
            "width": cfg.width,
            "params": cfg.num_params,
            "vocab": DEFAULT_VOCAB,
            "head_dim": HEAD_DIM,
            "seq": cfg.seq,
        },
        "config": {k: v for k, v in kw.items() if k != "dtype"} | {"dtype": args.dtype},
        "rss_before": before,
        "rows": [r.__dict__ for r in rows],
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def print_table(result: dict[str, Any]) -> None:
    m = result["model"]
    print(
        f"GPT {m['layers']} x {m['width']}, {m['params'] / 1e6:.0f}M params; "
        f"{result['config']}; RSS before initialize {_mib(result['rss_before'])} MiB"
    )
    print(
        f"{'MiB':<11}{'RSS':>7}{'peak':>7}{'ledger':>8}{'params':>8}{'grads':>7}{'optim':>7}"
        f"{'malloc':>8}{'mmapped':>8}{'kept':>7}"
    )
    for r in result["rows"]:
        led, mal = r["ledger_host"], r["malloc"] or {}
        print(
            f"{r['when']:<11}{_mib(r['rss']):>7}{_mib(r['peak']):>7}{_mib(sum(led.values())):>8}"
            f"{_mib(led['params']):>8}{_mib(led['grads']):>7}{_mib(led['optimizer']):>7}"
            f"{_mib(mal.get('arena_in_use')):>8}{_mib(mal.get('mmapped_in_use')):>8}"
            f"{_mib(mal.get('arena_free')):>7}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ranks > 1:
        result = measure_ranks(args)
        if args.json:
            print(json.dumps(result, indent=2))
            return 0
        for r, res in enumerate(result["ranks"]):
            print(f"rank {r}")
            print_table(res)
        print(
            f"sum of the ranks' peak RSS {_mib(result['sum_of_peaks'])} MiB; node budget "
            f"({DEFAULT_HOST_FRACTION:.0%} of available) {_mib(result['node_budget'])} MiB; "
            f"ratio {result['sum_of_peaks'] / result['node_budget']:.2f}"
        )
        return 0
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
