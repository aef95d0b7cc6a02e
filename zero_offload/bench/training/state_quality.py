"""``zero-offload bench state-quality``: what optimizer-state precision does to training.

A ~20M-parameter GPT (:mod:`.gpt`) trains on a fixed synthetic corpus (:func:`corpus`:
learnable, its entropy far below log(vocab)) once per state precision and
seed, with everything else equal: the same initial weights, batches, schedule and clipping
per seed. The optimizer is the engine's: every parameter in one flat run
(:class:`~zero_offload.optim.StateLayout`), stepped by :func:`zero_offload.optim.step` with
the weight-decayed and the undecayed parameters as two spans; fp32 compute, so a bf16
master hands its values to fp32 parameters each step, as the engine does.

Reports the held-out loss curve of each run, the final loss of each precision against fp32
AdamW (mean over seeds), and writes the curves as JSON and, with ``--plot``, a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from ...optim import Piece, ShardState, StateLayout, StatePolicy, StepHyper, step
from ..gpt import GPT, GPTConfig

VARIANTS = {
    "fp32": StatePolicy(),
    "8bit": StatePolicy.parse("adamw", "8bit", "fp32"),
    "8bit+bf16_sr": StatePolicy.parse("adamw", "8bit", "bf16_sr"),
    "8bit+bf16_kahan": StatePolicy.parse("adamw", "8bit", "bf16_kahan"),
}
MODEL = GPTConfig(layers=6, width=512, heads=8, vocab=128, seq=32)  # 19.0M parameters


@dataclass(frozen=True)
class Setup:
    model: GPTConfig = MODEL
    steps: int = 300
    batch: int = 4
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    eval_every: int = 25
    eval_batches: int = 4
    corpus_tokens: int = 400_000


def corpus(vocab: int, tokens: int, seed: int = 1234) -> torch.Tensor:
    """A fixed token stream from a random source with short- and long-range structure: a
    token follows its predecessor by a random bigram table (4 likely successors, Zipf
    weights) or, a quarter of the time, repeats the token 8 places back (which only
    attention can learn); 5% are uniform noise."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=gen).tolist()
    weights = torch.tensor([0.5, 0.25, 0.15, 0.1])
    choice = torch.multinomial(weights, tokens, replacement=True, generator=gen).tolist()
    mode = torch.rand(tokens, generator=gen).tolist()
    uniform = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
    o = uniform[:8] + [0] * (tokens - 8)
    for i in range(8, tokens):
        r = mode[i]
        o[i] = uniform[i] if r < 0.05 else o[i - 8] if r < 0.3 else succ[o[i - 1]][choice[i]]
    return torch.tensor(o)


def _windows(
    data: torch.Tensor, seq: int, starts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class FlatOptimizer:
    """The model's parameters as views of one flat fp32 buffer, their grads as views of
    another, and the optimizer state of the run under ``policy``."""

    def __init__(self, model: torch.nn.Module, policy: StatePolicy, s: Setup) -> None:
        params = list(model.parameters())
        decayed = [p for p in params if p.dim() >= 2]
        plain = [p for p in params if p.dim() < 2]  # biases and norms: no weight decay
        order = decayed + plain
        n = sum(p.numel() for p in order)
        self.values = torch.empty(n)
        self.grads = torch.zeros(n)
        at = 0
        for p in order:
            k = p.numel()
            self.values[at : at + k].copy_(p.detach().reshape(-1))
            p.data = self.values[at : at + k].view_as(p)
            p.grad = self.grads[at : at + k].view_as(p)
            at += k
        self.split = sum(p.numel() for p in decayed)
        layout = StateLayout.build(policy, [Piece(p.numel(), 0, p.numel()) for p in order])
        self.state = ShardState.zeros(layout.span())
        if policy.master.element_bytes == self.values.element_size():
            self.state.master = self.values  # an fp32 master is the parameters themselves
        else:
            self.state.load_fp32({"master": self.values})
        self.spans = [(layout.span(0, self.split), True), (layout.span(self.split, n), False)]
        self.setup, self.count = s, 0

    def step(self, lr: float) -> None:
        self.count += 1
        norm = float(self.grads.norm())
        factor = min(1.0, self.setup.clip / (norm + 1e-6))
        for span, decays in self.spans:
            sub = self.state.narrow(span)
            hyper = StepHyper(
                step=self.count,
                lr=lr,
                beta1=self.setup.betas[0],
                beta2=self.setup.betas[1],
                weight_decay=self.setup.weight_decay if decays else 0.0,
                grad_scale=factor,
            )
            out = None if self.state.master is self.values else self.values[span.lo : span.hi]
            step(sub, self.grads[span.lo : span.hi], hyper, out=out)
        self.grads.zero_()


def _lr(s: Setup, t: int) -> float:
    if t <= s.warmup:
        return s.lr * t / s.warmup
    progress = (t - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(policy: StatePolicy, seed: int, s: Setup, data: torch.Tensor) -> dict:
    """One run: held-out loss every ``eval_every`` steps, train loss every step."""
    torch.manual_seed(seed)
    model = GPT(s.model)
    opt = FlatOptimizer(model, policy, s)
    gen = torch.Generator().manual_seed(seed)
    split = int(0.9 * data.numel())
    held = torch.Generator().manual_seed(999)
    eval_starts = torch.randint(
        split, data.numel() - s.model.seq - 1, (s.eval_batches * 8,), generator=held
    )
    curve, train_losses = [], []

    def evaluate() -> float:
        with torch.no_grad():
            xs, ys = _windows(data, s.model.seq, eval_starts)
            return float(model(xs, ys))

    t0 = time.perf_counter()
    for t in range(1, s.steps + 1):
        starts = torch.randint(0, split - s.model.seq - 1, (s.batch,), generator=gen)
        x, y = _windows(data, s.model.seq, starts)
        loss = model(x, y)
        loss.backward()
        opt.step(_lr(s, t))
        train_losses.append(loss.item())
        if t % s.eval_every == 0 or t == s.steps:
            curve.append((t, evaluate()))
            rate = t / (time.perf_counter() - t0)
            print(
                f"    step {t}/{s.steps} held-out {curve[-1][1]:.4f} ({rate:.2f} steps/s)",
                file=sys.stderr,
                flush=True,
            )
    return {
        "eval": curve,
        "train": train_losses,
        "final_eval": curve[-1][1],
        "seconds": time.perf_counter() - t0,
        "state_bytes": opt.state.span.nbytes,
    }


def summarize(runs: dict[str, dict[int, dict]]) -> dict[str, dict]:
    """Per variant: mean final held-out loss over seeds and its ratio to fp32's (per seed,
    then averaged), the worst seed's ratio."""
    out = {}
    base = runs.get("fp32", {})
    for name, by_seed in runs.items():
        finals = [r["final_eval"] for r in by_seed.values()]
        ratios = [r["final_eval"] / base[k]["final_eval"] for k, r in by_seed.items() if k in base]
        out[name] = {
            "final_eval_mean": sum(finals) / len(finals),
            "vs_fp32_mean": sum(ratios) / len(ratios) if ratios else None,
            "vs_fp32_worst": max(ratios) if ratios else None,
            "state_bytes": next(iter(by_seed.values()))["state_bytes"],
        }
    return out


def _write(path: str, s: Setup, runs: dict, load: float) -> None:
    done = {k: v for k, v in runs.items() if v}
    with open(path, "w") as f:
        json.dump(
            {"setup": repr(s), "runs": done, "summary": summarize(done), "loadavg_start": load}, f
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=Setup.steps)
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer, width-64 model (a smoke run)"
    )
    parser.add_argument("--json", default=None, help="write curves and summary to this file")
    parser.add_argument("--plot", default=None, help="write the held-out curves as this PNG")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    parser.add_argument(
        "--replot", default=None, help="only redraw --plot from this --json file of an earlier run"
    )


def run(args: argparse.Namespace) -> int:
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        loaded = {n: {int(k): r for k, r in by.items()} for n, by in saved["runs"].items()}
        for path in plot(args.plot or args.replot.removesuffix(".json") + ".png", loaded, MODEL):
            print(path)
        for name, row in summarize(loaded).items():
            print(name, row)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    model = GPTConfig(layers=2, width=64, heads=4, vocab=128, seq=32) if args.tiny else MODEL
    s = Setup(
        model=model,
        steps=args.steps,
        lr=5e-3 if args.tiny else Setup.lr,  # a tiny model learns in a few dozen steps
        eval_every=max(1, min(25, args.steps // 4)),
    )
    data = corpus(model.vocab, 40_000 if args.tiny else s.corpus_tokens)
    load = os.getloadavg()[0]
    print(
        f"GPT {model.num_params / 1e6:.1f}M params, {s.steps} steps x {s.batch} x {model.seq} "
        f"tokens, seeds {args.seeds}, load avg {load:.1f}",
        file=sys.stderr,
    )
    runs: dict[str, dict[int, dict]] = {v: {} for v in args.variants}
    for seed in args.seeds:  # seeds outermost: a cut-short run still compares like with like
        for name in args.variants:
            r = train(VARIANTS[name], seed, s, data)
            runs[name][seed] = r
            print(
                f"  seed {seed} {name:16} final held-out loss {r['final_eval']:.4f} "
                f"({r['seconds']:.0f} s)",
                file=sys.stderr,
            )
            if args.json:  # after every run: a long campaign cut short keeps what it has
                _write(args.json, s, runs, load)
    summary = summarize(runs)
    for name, row in summary.items():
        ratio = (
            ""
            if row["vs_fp32_mean"] is None
            else (f"  x fp32 {row['vs_fp32_mean']:.4f} (worst seed {row['vs_fp32_worst']:.4f})")
        )
        print(f"{name:16} {VARIANTS[name].describe():44} loss {row['final_eval_mean']:.4f}{ratio}")
    if args.json:
        _write(args.json, s, runs, load)
    if args.plot:
        plot(args.plot, runs, model)
    return 0


def _mean_curves(runs: dict) -> dict[str, list[tuple[float, float]]]:
    out = {}
    for name, by_seed in runs.items():
        curves = list(by_seed.values())
        steps = [t for t, _ in curves[0]["eval"]]
        out[name] = [
            (t, sum(c["eval"][i][1] for c in curves) / len(curves)) for i, t in enumerate(steps)
        ]
    return out


def plot(path: str, runs: dict, model: GPTConfig | None = None) -> list[str]:
    """Two PNGs: held-out loss per variant (mean over seeds) at ``path``, and each
    variant's loss over fp32's (per seed, then averaged) beside it (``*_vs_fp32.png``)."""
    from .plot import line_plot

    seeds = len(next(iter(runs.values())))
    size = f"gpt {model.num_params / 1e6:.1f}m, " if model else ""
    means = _mean_curves(runs)
    line_plot(
        path,
        means,
        xlabel="step",
        ylabel="held-out loss",
        title=f"{size}held-out loss, mean of {seeds} seeds",
    )
    written = [path]
    if "fp32" in runs:
        ratios = {}
        for name, by_seed in runs.items():
            if name == "fp32":
                continue
            per = [
                [(t, y / runs["fp32"][k]["eval"][i][1]) for i, (t, y) in enumerate(r["eval"])]
                for k, r in by_seed.items()
                if k in runs["fp32"]
            ]
            ratios[name] = [
                (per[0][i][0], sum(p[i][1] for p in per) / len(per)) for i in range(len(per[0]))
            ]
        ratios["fp32"] = [(t, 1.0) for t, _ in means["fp32"]]
        second = path.removesuffix(".png") + "_vs_fp32.png"
        line_plot(
            second,
            ratios,
            xlabel="step",
            ylabel="loss / fp32 loss",
            title=f"{size}held-out loss over fp32 adamw's, mean of {seeds} seeds",
        )
        written.append(second)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero_offload.bench.training.state_quality",
        description=__doc__.splitlines()[0],
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
