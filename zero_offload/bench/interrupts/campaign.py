"""``zero-offload bench interrupts``: signals and full disks at random moments of a run.

What it answers: does a stage-3 run with optimizer and parameters on NVMe and the update in
its overlapped and early windows (``overlap_step``, ``step_during_backward``) survive what
ends real runs — Ctrl-C, a scheduler's SIGTERM, a disk that fills up — without losing a step?

- **Deliveries**: a training process (world 1 or 2) is sent SIGINT or SIGTERM at a seeded
  random moment of a step (after step ``j``, a random fraction of a step's time later, each
  rank at its own moment). World 1 with SIGINT runs a loop with
  ``except KeyboardInterrupt: engine.zero_grad(); engine.save_checkpoint(...)``; the others
  use ``save_on_preemption`` and must exit with status 128 + the signal. A new process then
  loads the checkpoint and trains two more steps: its parameters and optimizer state must be
  bit for bit those of an uninterrupted run at the same step, and no swap file may be left.
- **Disk faults**: the run's swap folder and checkpoints are on a small tmpfs (this needs
  root to mount it) and it saves a checkpoint after every step; at a random moment the disk
  is filled up to a random number of bytes below what a checkpoint needs (and further every
  two steps while the run still finds room, as its swap files shrink). The run must stop
  with a clear ``SwapIOError`` / ``CheckpointError`` (possibly as the cause of an
  ``IncompleteStepError``); once the space is back, a new process resumes from the last
  checkpoint and matches the uninterrupted run.

The model is tiny (the pipeline's moments, not its throughput, are under test), and a trial
costs a few process starts. Run: ``python -m zero_offload.bench.interrupts --deliveries 30
--disk-faults 20 --workdir DIR``; ``--json`` prints the counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .disk import fill_between_saves

TIMEOUT = 600.0  # seconds a child may stay silent (imports and startup on a loaded host)
KINDS = (  # (world, signal, the loop's way to handle it)
    (1, signal.SIGINT, "loop"),
    (1, signal.SIGTERM, "keyword"),
    (2, signal.SIGTERM, "keyword"),
    (2, signal.SIGINT, "keyword"),
)


# -- the campaign ---------------------------------------------------------------------------
@dataclass
class Trial:
    kind: str
    seed: int
    after_step: int = 0
    delay_s: float = 0.0
    saved_at: int | None = None
    exit_codes: list[int] = field(default_factory=list)
    error: str = ""
    equal: bool = False
    leftover_files: list[str] = field(default_factory=list)
    ok: bool = False
    why: str = ""


class _Run:
    """One training process per rank, read line by line."""

    def __init__(self, spec: dict[str, Any], world: int) -> None:
        port = _free_port()
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
            )
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
            env["LOCAL_WORLD_SIZE"] = str(world)
            child = json.dumps(dict(spec, rank=rank, world=world))
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "zero_offload.bench.interrupts.child", child],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )

    def line(self, rank: int = 0, timeout: float = TIMEOUT) -> str:
        proc = self.procs[rank]
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], timeout)[0]:
            return ""
        return proc.stdout.readline().strip()

    def finish(self, timeout: float = TIMEOUT) -> tuple[list[int], list[str], str]:
        codes, outs, errs = [], [], ""
        for proc in self.procs:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            codes.append(proc.returncode)
            outs.append(out)
            errs += err[-2000:]
        return codes, outs, errs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(work: Path, **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = dict(
        nvme=str(work / "nvme"),
        ckpt=str(work / "ckpt"),
        handler="loop",
        resume=False,
        until=10_000,
        save_every=0,
        record="",
        out="",
    )
    spec.update(kw)
    Path(spec["nvme"]).mkdir(parents=True, exist_ok=True)
    return spec


# Steps the reference runs past ``--steps``: a trial's process trains on until its signal
# lands, and on a loaded host the campaign reads its "step N" lines late, so the signal (and
# the save it causes) may come several steps after the one the trial aimed at.
LAG_STEPS = 8


def reference(work: Path, world: int, steps: int) -> Path:
    """An uninterrupted run's training state after every step, per rank (``steps`` and
    :data:`LAG_STEPS` more)."""
    steps += LAG_STEPS
    record = work / f"reference-w{world}"
    if record.is_dir() and (record / f"{steps}.0.pt").exists():
        return record
    record.mkdir(parents=True, exist_ok=True)
    run = _Run(_spec(work / f"ref-w{world}", until=steps, record=str(record)), world)
    codes, _, err = run.finish()
    if any(codes):
        raise RuntimeError(f"the reference run failed ({codes}): {err}")
    return record


def _equal(record: Path, step: int, out: str, world: int) -> bool:
    for rank in range(world):
        want = torch.load(record / f"{step}.{rank}.pt")
        got = torch.load(f"{out}.{rank}")
        if want.keys() != got.keys() or not all(torch.equal(want[k], got[k]) for k in want):
            return False
    return True


def _resume(trial: Trial, work: Path, record: Path, world: int, steps: int, **kw: Any) -> None:
    """A new process loads the checkpoint and trains two steps; compared with the record."""
    out = str(work / "resumed.pt")
    last = steps + LAG_STEPS  # the reference's last step
    run = _Run(_spec(work, resume=True, until=last, out=out, **kw), world)
    line = run.line()
    codes, outs, err = run.finish()
    if not line.startswith("resumed ") or any(codes):
        trial.why = f"resume failed ({codes}): {line} {err[-1500:]}"
        return
    trial.saved_at = int(line.split()[1])
    ended = int(outs[0].strip().splitlines()[-1].split()[1])
    if ended > last:
        trial.why = f"saved at step {trial.saved_at}, past the reference's {last}: read too late"
        return
    trial.equal = _equal(record, ended, out, world)


def delivery(work: Path, record: Path, kind: int, seed: int, steps: int) -> Trial:
    world, signum, handler = KINDS[kind]
    name = f"w{world}-{signal.Signals(signum).name}-{handler}"
    trial = Trial(name, seed)
    rng = random.Random(seed)
    shutil.rmtree(work, ignore_errors=True)
    spec = _spec(work, handler=handler)
    run = _Run(spec, world)
    trial.after_step = rng.randint(1, steps - 4)
    stamps = []
    while True:
        line = run.line()
        if not line.startswith("step "):
            codes, _, err = run.finish()
            trial.why = f"the run ended before the signal ({codes}): {line} {err[-1500:]}"
            return trial
        stamps.append(time.monotonic())
        if int(line.split()[1]) >= trial.after_step:
            break
    step_s = (stamps[-1] - stamps[-2]) if len(stamps) > 1 else 1.0
    delays = sorted(rng.uniform(0, 1.5 * step_s) for _ in range(world))
    trial.delay_s = round(delays[0], 3)
    start = time.monotonic()
    for rank, delay in enumerate(delays):  # each rank at its own moment
        time.sleep(max(0.0, start + delay - time.monotonic()))
        run.procs[rank].send_signal(signum)
    trial.exit_codes, outs, err = run.finish()
    want = 0 if handler == "loop" else 128 + signum
    # A rank whose own signal lands once it is exiting after the agreed save (the others
    # stopped it first) dies by the signal: Python gives back the default dispositions as
    # the interpreter ends. That is the same status to a scheduler; it is counted apart.
    late = [r for r, code in enumerate(trial.exit_codes) if code == -signum and want]
    if late:
        trial.error = f"rank(s) {late} ended by their own signal while exiting"
    if any(code != want and r not in late for r, code in enumerate(trial.exit_codes)):
        trial.why = f"exit codes {trial.exit_codes}, expected {want}: {err[-1500:]}"
        return trial
    trial.leftover_files = _files(Path(spec["nvme"]))
    _resume(trial, work, record, world, steps)
    trial.leftover_files += _files(Path(spec["nvme"]))
    trial.ok = trial.equal and not trial.leftover_files and not trial.why
    return trial


def _files(folder: Path) -> list[str]:
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]


def disk_fault(work: Path, record: Path, seed: int, steps: int, size_mb: int) -> Trial:
    trial = Trial("w1-disk-full", seed)
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    mount = work / "disk"
    mount.mkdir(exist_ok=True)
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if res.returncode:
        trial.why = f"cannot mount a tmpfs (needs root): {res.stderr.strip()}"
        return trial
    try:
        trial.after_step = rng.randint(1, steps - 4)
        # Bounded: a disk that never fills ends the run in a few steps, not at the timeout.
        spec = _spec(mount, save_every=1, until=trial.after_step + LAG_STEPS)
        run = _Run(spec, 1)
        while True:
            line = run.line()
            if not line.startswith("step "):
                trial.why = f"the run ended early: {line} {run.finish()[2][-1500:]}"
                return trial
            if int(line.split()[1]) >= trial.after_step:
                break
        time.sleep(rng.uniform(0, 0.5))
        trial.delay_s = left = fill_between_saves(run.procs[0], Path(spec["ckpt"]), mount, rng)
        # The swap files grow and shrink within a step, so a save may still find room: then
        # the disk fills further (to fewer bytes left) after every two more steps.
        seen, since = [], 0
        while (line := run.line()).startswith("step "):
            seen.append(line)
            since += 1
            if since == 2:
                left = fill_between_saves(run.procs[0], Path(spec["ckpt"]), mount, rng, left)
                since = 0
        codes, outs, err = run.finish()
        trial.exit_codes = codes
        lines = [*seen, line, *outs[0].splitlines()]
        trial.error = next((ln for ln in lines if ln.startswith("error ")), "")
        clear = any(name in trial.error for name in ("SwapIOError", "CheckpointError"))
        if codes != [3] or not clear:
            trial.why = f"expected a SwapIOError/CheckpointError, got {codes}: {err[-1500:]}"
            return trial
        (mount / "ballast").unlink(missing_ok=True)  # the space is back
        trial.leftover_files = _files(Path(spec["nvme"]))
        _resume(trial, mount, record, 1, steps)
        trial.leftover_files += _files(Path(spec["nvme"]))
        trial.ok = trial.equal and not trial.leftover_files and not trial.why
        return trial
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def campaign(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    records = {}
    for world in sorted({KINDS[k][0] for k in range(len(KINDS))} if args.deliveries else {1}):
        if world > 1 and args.deliveries < 3:
            continue
        records[world] = reference(work, world, args.steps)
    jobs: list[tuple[Callable[..., Trial], tuple[Any, ...]]] = []  # each in its own folder
    faults: list[tuple[Callable[..., Trial], tuple[Any, ...]]] = []
    for n in range(args.deliveries):
        kind = n % len(KINDS) if args.deliveries >= len(KINDS) else (0, 1)[n % 2]
        record = records[KINDS[kind][0]]
        jobs.append((delivery, (work / f"trial{n}", record, kind, rng.randrange(2**31))))
    for n in range(args.disk_faults):
        seed = rng.randrange(2**31)
        faults.append((disk_fault, (work / f"fault{n}", records[1], seed)))
    # interleaved, so that a campaign stopped early has run both kinds
    for n, fault in enumerate(faults):
        jobs.insert(min(len(jobs), n * 3 // 2 + n), fault)

    def run(job: tuple) -> Trial:
        fn, fargs = job
        trial = fn(*fargs, args.steps, *((args.disk_mb,) if fn is disk_fault else ()))
        _report(trial, args)
        return trial

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        trials: list[Trial] = list(pool.map(run, jobs))
    kinds = sorted({t.kind for t in trials})
    summary = {
        k: {
            "trials": sum(t.kind == k for t in trials),
            "ok": sum(t.ok for t in trials if t.kind == k),
        }
        for k in kinds
    }
    return {"summary": summary, "trials": [asdict(t) for t in trials]}


def _report(trial: Trial, args: argparse.Namespace) -> None:
    if not args.json:
        state = "ok" if trial.ok else f"FAILED: {trial.why or 'state differs'}"
        print(
            f"{trial.kind:22s} seed={trial.seed:<10d} after step {trial.after_step} "
            f"+{trial.delay_s} saved at {trial.saved_at} exit {trial.exit_codes} "
            f"{trial.error[:60]} {state}",
            flush=True,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deliveries", type=int, default=30, help="SIGINT/SIGTERM trials")
    parser.add_argument("--disk-faults", type=int, default=20, help="disk-full trials")
    parser.add_argument("--steps", type=int, default=8, help="steps of the reference run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="trials run at once")
    parser.add_argument("--disk-mb", type=int, default=24, help="the tmpfs of a disk fault")
    parser.add_argument("--workdir", default="interrupts-campaign")
    parser.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero_offload.bench.interrupts", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    result = campaign(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for kind, counts in result["summary"].items():
            print(f"{kind}: {counts['ok']} of {counts['trials']} resumed bit for bit")
    return 0 if all(t["ok"] for t in result["trials"]) else 1


if __name__ == "__main__":
    sys.exit(main())
