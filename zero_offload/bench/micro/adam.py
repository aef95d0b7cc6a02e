"""``zero-offload bench adam``: CPU Adam step throughput against torch and the memory ceiling.

Why this shape: the step is memory bound and this kind of host's bandwidth drifts minute to
minute, so every variant runs once per round, interleaved, on the same buffers and threads,
and ratios are taken within a round (paired), then summarized over rounds. Buffers are
allocated and touched once before timing (first-touch page faults cost more than the step).

Paths: ``fp32`` (fp32 grads in, params updated in place) and ``bf16`` (the offload path:
bf16 grads in, params also written out as bf16). Bytes per param are the minimum each
variant must move: 28 for a fused pass; torch's bf16 path adds a grad cast (2 read + 4
written) and a param cast (4 read + 2 written), 40 in all.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

from zero_offload.optim.native import KernelBuildError, build, load_library
from zero_offload.optim.native import adam_kernel as K
from zero_offload.progress import clear_status, show_status
from zero_offload.quantities import parse_count

from .adam_states import POLICIES, Variant, state_variants

DEFAULT_PARAMS = 100_000_000
DEFAULT_ROUNDS = 5
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zero-offload bench adam``."""
    parser.add_argument(
        "--params",
        type=parse_count,
        default=DEFAULT_PARAMS,
        help="parameters in the one flat tensor (default 100_000_000)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for every variant (default: physical cores)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="timed rounds; each runs every variant once, interleaved",
    )
    parser.add_argument(
        "--states",
        default="all",
        help="optimizer-state variants to add: 'all' (default), 'none', or comma-separated "
        f"labels from: {', '.join(label for label, _ in POLICIES)}; 'all' also runs torchao's "
        "and bitsandbytes' AdamW8bit when installed",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def _torch_opt(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, **kw: bool
) -> torch.optim.Optimizer:
    """A torch AdamW whose state is our m / v, so no variant allocates its own state."""
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
    return opt


def _variants(n: int, threads: int, states: str = "none") -> list[Variant]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g32 = torch.randn(n, generator=gen)
    m = torch.zeros(n).add_(g32, alpha=0.1)
    v = torch.zeros(n).addcmul_(g32, g32, value=1e-3)
    g16 = g32.to(torch.bfloat16)
    out16 = torch.zeros(n, dtype=torch.bfloat16)
    p.grad = g32
    fused, foreach = _torch_opt(p, m, v, fused=True), _torch_opt(p, m, v, foreach=True)
    step = [0]

    def ours(
        grad: torch.Tensor, out: torch.Tensor | None, openmp: bool | None = None
    ) -> Callable[[], None]:
        def fn() -> None:
            step[0] += 1
            hyper = K.AdamHyper(
                step=step[0],
                lr=LR,
                beta1=BETAS[0],
                beta2=BETAS[1],
                eps=EPS,
                weight_decay=WD,
                adamw=True,
                grad_scale=1.0,
            )
            k = K.get_kernel()
            if openmp is None or k is None:  # the public path (native, or torch fallback)
                K.adam_update(p, grad, m, v, out=out, num_threads=threads, **hyper)
            else:  # a forced thread-split mechanism, to compare the two
                K.native_update(k, p, grad, m, v, out, K.adam_scalars(**hyper), threads, openmp)

        return fn

    def torch_bf16(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def fn() -> None:
            g32.copy_(g16)
            opt.step()
            out16.copy_(p)

        return fn

    out: list[Variant] = []
    try:
        tl = load_library("adam_traffic", build.KERNEL_FLAGS + build.OPENMP_FLAGS)
        tl.zo_traffic_omp.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int]
        ptrs = [t.data_ptr() for t in (p, m, v, g32)]
        out.append(
            Variant(
                "mem",
                "ceiling: read 4 / write 3 fp32 (C)",
                lambda: tl.zo_traffic_omp(*ptrs, n, threads),
                28,
            )
        )
    except KernelBuildError:  # no compiler: no ceiling, the rest still runs
        pass
    fused_name, fused16_name = "torch AdamW fused=True", "torch fused=True + casts"
    native = K.get_kernel()
    out += [
        Variant("fp32", fused_name, fused.step, 28),
        Variant("fp32", "torch AdamW foreach=True", foreach.step, 28, fused_name),
        Variant("fp32", "zero_offload CPUAdam", ours(g32, None), 28, fused_name, True),
        Variant("bf16", fused16_name, torch_bf16(fused), 40),
        Variant("bf16", "torch foreach=True + casts", torch_bf16(foreach), 40, fused16_name),
        Variant(
            "bf16", "zero_offload CPUAdam, fused out", ours(g16, out16), 28, fused16_name, True
        ),
    ]
    if states != "none":
        kinds = None if states == "all" else [k.strip() for k in states.split(",")]
        out += state_variants(p, g32, g16, threads, kinds)
    if native is not None and native.openmp:  # the measurement behind choosing OpenMP
        out.insert(
            4,
            Variant(
                "fp32", "zero_offload, python-thread split", ours(g32, None, False), 28, fused_name
            ),
        )
        out.append(
            Variant(
                "bf16",
                "zero_offload, python-thread split",
                ours(g16, out16, False),
                28,
                fused16_name,
            )
        )
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _paired(v: Variant, base: Variant) -> float:
    """Median over rounds of base time / v time: v's speed-up, paired within each round."""
    return statistics.median(b / s for s, b in zip(v.seconds, base.seconds))


def _summarize(variants: list[Variant], n: int) -> list[dict]:
    by_name = {v.name: v for v in variants}
    ceiling = next((v for v in variants if v.path == "mem"), None)
    rows = []
    for v in variants:
        pps = [n / s for s in v.seconds]
        gbs = [n * v.bytes_per_param / s / 1e9 for s in v.seconds]
        row = {
            "path": v.path,
            "variant": v.name,
            "bytes_per_param": v.bytes_per_param,
            "seconds": _stats(v.seconds),
            "params_per_s": _stats(pps),
            "gb_per_s": _stats(gbs),
            "ours": v.ours,
        }
        base = by_name.get(v.baseline or "") if v.baseline else None
        if v.path != "mem" and v.baseline is None:
            row["ratio"], row["baseline"] = 1.0, v.name
        if base is not None:  # paired within each round
            row["ratio"], row["baseline"] = _paired(v, base), base.name
        found = {k: by_name[b] for k, b in v.targets.items() if b in by_name}
        if found:
            row["targets"] = {k: _paired(v, b) for k, b in found.items()}
        if ceiling is not None:
            cg = [n * 28 / s / 1e9 for s in ceiling.seconds]
            row["fraction_of_ceiling"] = statistics.median(x / c for x, c in zip(gbs, cg))
        rows.append(row)
    return rows


def _table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        f"{'path':5} {'variant':42} {'ms min/med/max':>20} {'Mparam/s':>9} "
        f"{'GB/s min/med/max':>17} {'B/p':>5} {'x baseline':>10} {'of ceiling':>10}",
    ]
    for r in rows:
        s, gb = r["seconds"], r["gb_per_s"]
        ms = f"{s['min'] * 1e3:.1f}/{s['median'] * 1e3:.1f}/{s['max'] * 1e3:.1f}"
        gbs = f"{gb['min']:.1f}/{gb['median']:.1f}/{gb['max']:.1f}"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        frac = f"{r['fraction_of_ceiling'] * 100:.0f}%" if "fraction_of_ceiling" in r else "-"
        lines.append(
            f"{r['path']:5} {r['variant'][:42]:42} {ms:>20} "
            f"{r['params_per_s']['median'] / 1e6:9.0f} {gbs:>17} {r['bytes_per_param']:5.1f} "
            f"{ratio:>10} {frac:>10}"
        )
    targets = [r for r in rows if r.get("targets")]
    if targets:
        lines += ["", "speed-ups (params/s), medians of per-round pairs:"]
        for r in targets:
            pairs = ", ".join(f"{k} {x:.2f}x" for k, x in r["targets"].items())
            lines.append(f"  {r['path']:5} {r['variant']:42} {pairs}")
    lines.append("")
    lines.append(
        "x baseline: against torch's fused AdamW on the path (our new kinds: against our fp32 "
        "kernel); ratios and fractions are medians of per-round pairs (variants interleaved "
        "in each round); GB/s counts the bytes each variant must move (B/p); of ceiling: that "
        "GB/s over the memory-traffic kernel's."
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; prints a table (or JSON with --json). Returns the exit code."""
    n, rounds = int(args.params), int(args.rounds)
    threads = args.threads or K.default_num_threads()
    if n < 1 or rounds < 1 or threads < 1:
        print("--params, --rounds and --threads must be >= 1", file=sys.stderr)
        return 2
    labels = [label for label, _ in POLICIES]
    wanted = (
        [k.strip() for k in args.states.split(",")] if args.states not in ("all", "none") else []
    )
    unknown = [k for k in wanted if k not in labels]
    if unknown:
        print(
            f"--states: unknown {unknown}; choose from {labels}, 'all' or 'none'", file=sys.stderr
        )
        return 2
    torch.set_num_threads(threads)
    print(f"allocating and touching {n:,} params...", file=sys.stderr)
    variants = _variants(n, threads, args.states)
    load_before = os.getloadavg()[0]
    for v in variants:  # warm-up: builds, first-call costs, torch's lazy state
        v.fn()
    for r in range(rounds):
        for v in variants:
            show_status(f"round {r + 1}/{rounds}: {v.path} {v.name}")
            t0 = time.perf_counter()
            v.fn()
            v.seconds.append(time.perf_counter() - t0)
    clear_status()
    rows = _summarize(variants, n)
    kernel = K.kernel_status()
    load = f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"  # others running skew absolutes
    if args.json:
        print(
            json.dumps(
                {
                    "bench": "adam",
                    "params": n,
                    "threads": threads,
                    "rounds": rounds,
                    "kernel": kernel,
                    "torch": torch.__version__,
                    "loadavg_1m": load,
                    "results": rows,
                },
                indent=2,
            )
        )
    else:
        print(
            _table(
                rows,
                f"CPU Adam step, {n:,} params, {threads} threads, {rounds} rounds; "
                f"kernel: {kernel}; torch {torch.__version__}; load avg {load}",
            )
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero_offload.bench.micro.adam", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
