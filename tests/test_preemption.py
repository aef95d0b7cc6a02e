"""Preemption as schedulers do it: SIGTERM lands somewhere in a step, the loop's own handler
asks it to stop, the loop finishes the step it is in, saves and exits; a new process resumes
from the checkpoint and ends where an uninterrupted run ends, bit for bit, and no swap file
outlives either process."""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from support.children import next_line, start_python

T = 180  # seconds for a child to import torch and train on a loaded machine

LOOP = """
import json, signal, sys, torch
sys.path.insert(0, "tests")
import zero_offload as zo
from support.models import TinyGPT, batch, loss_fn

ckpt, nvme = sys.argv[1:3]
kwargs = json.loads(sys.argv[3])
kwargs["dtype"] = getattr(torch, kwargs["dtype"])
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
for mode, until, out in json.loads(sys.argv[4]):  # the runs, one after another
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), nvme_path=nvme, **kwargs)
    if mode == "resume":
        engine.load_checkpoint(ckpt)
    i = engine.optimizer_steps
    while i < until and not stop:
        x, y = batch("gpt", 8, torch.Generator().manual_seed(100 + i))
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
        i += 1
        print("step", i, flush=True)
    if stop:  # preempted: the step that was running has ended; keep it
        engine.save_checkpoint(ckpt)
    print("ended", engine.optimizer_steps, flush=True)
    torch.save(engine.full_state_dict(), out)
    engine.close()
"""

CONFIGS = {
    # stage 0: the params' .grad are views of the gradient buffer
    "stage0-fp32": dict(stage=0, dtype="float32", lr=1e-2, weight_decay=0.1),
    # stage 3, everything in files, the update running under the next forward
    "stage3-nvme-bf16": dict(
        stage=3,
        dtype="bfloat16",
        lr=1e-2,
        weight_decay=0.1,
        offload_optimizer="nvme",
        offload_param="nvme",
        sub_group_size=3000,
        overlap_step=True,
    ),
}


def _start(tmp: Path, kwargs: dict, *runs: tuple[str, int, str]) -> subprocess.Popen:
    """A child that makes ``runs`` (mode, steps to reach, output file) one after another: a
    resumed run and then the uninterrupted one share a process (torch is imported once)."""
    runs_json = json.dumps([(mode, until, str(tmp / out)) for mode, until, out in runs])
    args = [str(tmp / "ckpt"), str(tmp / "nvme"), json.dumps(kwargs), runs_json]
    return start_python(textwrap.dedent(LOOP), *args)


def _line(proc: subprocess.Popen) -> str:
    return next_line(proc, T)


def _ended(proc: subprocess.Popen) -> list[int]:
    """The optimizer steps at the end of each of the child's runs, once it exited cleanly."""
    out, err = proc.communicate(timeout=T)
    assert proc.returncode == 0, err[-3000:]
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("ended")]


def _resume_matches_straight(tmp: Path, kwargs: dict, saved: int) -> None:
    """Resume from the checkpoint in a new process, then run uninterrupted to the same step;
    both end bit for bit alike, and no swap folder is left."""
    both = _start(
        tmp, kwargs, ("resume", saved + 2, "resumed.pt"), ("straight", saved + 2, "straight.pt")
    )
    assert _ended(both) == [saved + 2, saved + 2]
    a = torch.load(tmp / "straight.pt")
    b = torch.load(tmp / "resumed.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert list((tmp / "nvme").iterdir()) == []  # every run's swap folder went with it


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sigterm_mid_run_saves_at_the_step_end_and_resumes_bit_exact(name, tmp_path):
    kwargs = CONFIGS[name]
    (tmp_path / "nvme").mkdir()
    first = _start(tmp_path, kwargs, ("preempted", 10_000, "first.pt"))
    assert _line(first) == "step 1"
    first.send_signal(signal.SIGTERM)  # lands wherever step 2 (or a later one) is
    [saved] = _ended(first)
    assert saved >= 1
    _resume_matches_straight(tmp_path, kwargs, saved)


@pytest.mark.multiprocess
def test_save_on_preemption_saves_at_the_step_end_and_exits_with_the_signal(tmp_path):
    """The keyword instead of the loop's handler: the engine saves at the step that ends
    after SIGTERM, and the process ends with the status a kill by SIGTERM has."""
    kwargs = dict(
        CONFIGS["stage3-nvme-bf16"],
        save_on_preemption=str(tmp_path / "ckpt"),
        max_grad_norm=None,  # with the pass during backward too
    )
    (tmp_path / "nvme").mkdir()
    first = _start(tmp_path, kwargs, ("preempted", 10_000, "first.pt"))
    assert _line(first) == "step 1"
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=T)
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = int((tmp_path / "ckpt" / "latest").read_text().removeprefix("step"))
    assert saved >= 1
    _resume_matches_straight(tmp_path, kwargs, saved)


AFTER_LAST_STEP = """
import os, signal, sys, torch
import zero_offload as zo

engine = zo.initialize(torch.nn.Linear(4, 4), stage=0, save_on_preemption=sys.argv[1])
for _ in range(2):
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's, after the loop's last step()
print("evaluating", flush=True)
engine.close()
print("still running after close", flush=True)
"""


def test_a_signal_after_the_last_step_is_delivered_at_close(tmp_path):
    """No step() follows to agree on the signal and save: close() puts the previous
    disposition back and delivers the signal to it, so the process ends as the scheduler
    asked (143), where it used to run on and exit 0."""
    from support.children import run_python

    done = run_python(AFTER_LAST_STEP, str(tmp_path / "ckpt"), timeout=T)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert "evaluating" in done.stdout and "still running" not in done.stdout
    assert "no step() followed" in done.stderr
