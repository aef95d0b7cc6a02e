"""Checkpoints: exact resume in a new process, another world size, consolidation with bounded
memory, and damaged or interrupted checkpoints that never replace a good one."""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from support.distributed import run_ranks
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.checkpoint import CheckpointError

CONFIGS = [(s, o) for s in (1, 2, 3) for o in ("none", "cpu", "nvme")]


def _kwargs(stage, offload, nvme):
    kw = dict(
        stage=stage,
        lr=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.05,
        offload_optimizer=offload,
        nvme_path=nvme,
        sub_group_size=3000,
    )
    if stage == 3:
        kw["offload_param"] = offload
    return kw


def _steps(engine, rank, world, start, end):
    for i in range(start, end):
        x, y = batch("gpt", 8, torch.Generator().manual_seed(100 + i))
        per = 8 // world
        sl = slice(rank * per, (rank + 1) * per)
        engine.backward(loss_fn("gpt", engine(x[sl]), y[sl]))
        engine.step()


def _optimizer_state(engine) -> dict[str, torch.Tensor]:
    """This rank's flat [master | m | v] and the step count, as plain tensors."""
    # clone each piece as it comes: NVMe state arrives in pool buffers that the next piece reuses
    chunks = [
        [a.clone() for a in arrays]
        for _lo, arrays in engine.state_chunks()
        if arrays[1] is not None
    ]
    parts = [torch.cat([c[k] for c in chunks]) for k in range(3)]
    return {
        "master": parts[0],
        "exp_avg": parts[1],
        "exp_avg_sq": parts[2],
        "steps": torch.tensor(engine.optimizer_steps),
    }


def _train(rank, world, ckpt, nvme, phase):
    """phase 'before': for every config, 6 steps straight, then 3 steps + save in a fresh
    engine; 'resume': load + 3 steps (in processes that did not save)."""
    out = {}
    for stage, offload in CONFIGS:
        runs = ("straight", "first") if phase == "before" else ("resume",)
        for run in runs:
            torch.manual_seed(0 if run != "resume" else 1)  # resume must not rely on init
            engine = zo.initialize(TinyGPT(), **_kwargs(stage, offload, nvme))
            if run == "resume":
                engine.load_checkpoint(ckpt, tag=f"s{stage}-{offload}")
                _steps(engine, rank, world, 3, 6)
            else:
                _steps(engine, rank, world, 0, 3 if run == "first" else 6)
                if run == "first":
                    engine.save_checkpoint(ckpt, tag=f"s{stage}-{offload}")
            if run != "first":
                out[(stage, offload)] = (engine.full_state_dict(), _optimizer_state(engine))
            engine.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_resume_in_a_new_process_is_bit_exact(world, tmp_path):
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    straight = run_ranks(world, _train, str(tmp_path), nvme, "before")
    resumed = run_ranks(world, _train, str(tmp_path), nvme, "resume")
    for rank in range(world):
        assert set(straight[rank]) == set(resumed[rank]) == set(CONFIGS)
        for key in straight[rank]:
            params_a, opt_a = straight[rank][key]
            params_b, opt_b = resumed[rank][key]
            for name in params_a:
                assert torch.equal(params_a[name], params_b[name]), (key, name)
            for name in opt_a:
                assert torch.equal(opt_a[name], opt_b[name]), (key, name)


RESHARD_STAGES = (0, 1, 2, 3)


def _reshard_paths(root, stage):
    """The checkpoint folder and the NVMe folder of one stage's case."""
    return os.path.join(root, f"stage{stage}"), os.path.join(root, f"nvme{stage}")


def _each_stage(fn, rank, world, root):
    """fn(rank, world, ckpt, nvme, stage, offload) for every stage, in one set of processes
    (spawning costs seconds; the cases are tiny). A stage that raises reports its traceback
    and the others still run: the ranks run the same code, so an error leaves the stage on
    every rank, not in the middle of a collective that the others wait in."""
    out = {}
    for stage in RESHARD_STAGES:
        ckpt, nvme = _reshard_paths(root, stage)
        try:
            out[stage] = fn(rank, world, ckpt, nvme, stage, "none" if stage == 0 else "nvme")
        except Exception:  # noqa: BLE001 - reported by that stage's test
            out[stage] = traceback.format_exc()
    return out


def _save_then_report(rank, world, ckpt, nvme, stage, offload):
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), **_kwargs(stage, offload, nvme))
    _steps(engine, rank, world, 0, 2)
    engine.save_checkpoint(ckpt, tag="t")
    sd = engine.full_state_dict()
    engine.close()
    return sd


def _load_then_report(rank, world, ckpt, nvme, stage, offload):
    torch.manual_seed(5)
    engine = zo.initialize(TinyGPT(), **_kwargs(stage, offload, nvme))
    engine.load_checkpoint(ckpt)
    sd = engine.full_state_dict()
    steps = engine.optimizer_steps
    _steps(engine, rank, world, 2, 3)  # and it keeps training
    engine.close()
    return sd, steps


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Every stage saved on two ranks, then loaded on one and on four: three spawns in all."""
    root = str(tmp_path_factory.mktemp("reshard"))
    for stage in RESHARD_STAGES:
        os.makedirs(_reshard_paths(root, stage)[1])
    saved = run_ranks(2, functools.partial(_each_stage, _save_then_report), root)[0]
    loaded = {
        world: run_ranks(world, functools.partial(_each_stage, _load_then_report), root)
        for world in (1, 4)
    }
    return root, saved, loaded


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", RESHARD_STAGES)
def test_saved_on_two_ranks_loads_on_one_and_four(stage, resharded):
    root, saved, loaded = resharded
    saved = saved[stage]
    assert not isinstance(saved, str), saved
    consolidated = zo.consolidate_checkpoint(_reshard_paths(root, stage)[0])
    for world in (1, 4):
        assert len(loaded[world]) == world
        for rank_results in loaded[world]:
            assert not isinstance(rank_results[stage], str), rank_results[stage]
            sd, steps = rank_results[stage]
            assert steps == 2
            for name in saved:
                assert torch.equal(saved[name], sd[name]), (world, name)
                assert torch.equal(saved[name], consolidated[name]), name


def test_consolidate_cli_and_tied_names(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    engine = zo.initialize(model, stage=3, lr=1e-2)
    _steps(engine, 0, 1, 0, 1)
    engine.save_checkpoint(tmp_path / "ck")
    want = engine.full_state_dict()
    out = tmp_path / "full.pt"
    from zero_offload.cli import main

    assert main(["consolidate", str(tmp_path / "ck"), str(out)]) == 0
    from safetensors import safe_open
    from safetensors.torch import load_file

    got = load_file(str(out))  # safetensors is a dependency: consolidate writes it
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"alias:lm_head.weight": "wte.weight"}  # the tie, recorded
    assert set(want) == set(got) | {"lm_head.weight"}
    for name, value in got.items():
        assert torch.equal(value, want[name]), name
    fresh = TinyGPT()
    fresh.load_state_dict(zo.consolidate_checkpoint(tmp_path / "ck"))


def _good_and_bad(tmp_path):
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), stage=2, lr=1e-2)
    _steps(engine, 0, 1, 0, 1)
    engine.save_checkpoint(tmp_path, tag="good")
    good = engine.full_state_dict()
    _steps(engine, 0, 1, 1, 2)
    engine.save_checkpoint(tmp_path, tag="bad")
    return engine, good


@pytest.mark.parametrize("damage", ["missing", "truncated", "checksum", "version", "manifest"])
def test_damaged_checkpoint_is_named_and_the_previous_one_still_loads(tmp_path, damage):
    engine, good = _good_and_bad(tmp_path)
    bad = tmp_path / "bad"
    state = bad / "rank0.state"
    if damage == "missing":
        state.unlink()
    elif damage == "truncated":
        with open(state, "r+b") as f:
            f.truncate(state.stat().st_size - 4)
    elif damage == "checksum":
        with open(state, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "version":
        m = json.loads((bad / "manifest.json").read_text())
        m["format_version"] = 99
        (bad / "manifest.json").write_text(json.dumps(m))
    else:
        (bad / "manifest.json").unlink()
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(tmp_path, tag="bad")
    named = "manifest.json" if damage in ("version", "manifest") else "rank0.state"
    assert named in str(err.value)
    after = engine.full_state_dict()  # nothing was used before the checks passed
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.load_checkpoint(tmp_path, tag="good")
    now = engine.full_state_dict()
    assert all(torch.equal(good[k], now[k]) for k in good)


def test_names_that_do_not_match_are_listed(tmp_path):
    engine = zo.initialize(TinyGPT(), stage=1)
    engine.save_checkpoint(tmp_path)
    other = zo.initialize(TinyGPT(layers=1), stage=1)
    with pytest.raises(CheckpointError, match=r"not in the model: \['blocks\.1\."):
        other.load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        other.load_checkpoint(tmp_path / "nothing-here")


def test_lr_scheduler_and_loss_scale_come_back(tmp_path):
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(), stage=2, lr=1.0, dtype=torch.float16, initial_loss_scale=2.0**10
    )
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    for i in range(3):
        _steps(engine, 0, 1, i, i + 1)
        sched.step()
    state = engine.training_state()
    engine.load_training_state({**state, "loss_scaler": {**state["loss_scaler"], "scale": 123.0}})
    engine.save_checkpoint(tmp_path, lr_scheduler=sched)
    other = zo.initialize(TinyGPT(), stage=2, lr=1.0, dtype=torch.float16)
    sched2 = torch.optim.lr_scheduler.StepLR(other.optimizer, step_size=1, gamma=0.5)
    other.load_checkpoint(tmp_path, lr_scheduler=sched2)
    assert other.param_groups[0]["lr"] == engine.param_groups[0]["lr"] == 0.125
    assert sched2.last_epoch == 3 and other.loss_scale == 123.0
    assert other.global_steps == engine.global_steps


def test_a_scheduler_the_checkpoint_lacks_is_left_with_a_warning(tmp_path, caplog):
    """A checkpoint saved without the loop's scheduler (the automatic one of
    save_on_preemption, which knows only engine.lr_scheduler) cannot restore it: the
    scheduler passed to load_checkpoint stays as it is, and the log says so."""
    engine = zo.initialize(TinyGPT(), stage=2, lr=1.0)
    _steps(engine, 0, 1, 0, 1)
    engine.save_checkpoint(tmp_path)  # no scheduler
    other = zo.initialize(TinyGPT(), stage=2, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(other.optimizer, step_size=1, gamma=0.5)
    with caplog.at_level("WARNING", logger="zero_offload.checkpoint.load"):
        other.load_checkpoint(tmp_path, lr_scheduler=sched)
    assert "no lr scheduler state" in caplog.text and "engine.lr_scheduler" in caplog.text
    assert sched.last_epoch == 0
    engine.close()
    other.close()


KILLER = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    import zero_offload as zo
    import zero_offload.checkpoint.save as save
    from support.models import TinyGPT
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), stage=2)
    engine.save_checkpoint({root!r}, tag="first")
    real = save._write_state
    def write_then_die(engine, path):
        real(engine, path)
        os.kill(os.getpid(), signal.SIGKILL)
    save._write_state = write_then_die
    engine.save_checkpoint({root!r}, tag="second")
""")


def test_killed_save_leaves_the_previous_checkpoint_and_latest(tmp_path):
    script = KILLER.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "latest").read_text() == "first"
    assert not (tmp_path / "second").exists()
    engine = zo.initialize(TinyGPT(), stage=2)
    assert engine.load_checkpoint(tmp_path) == "first"


RSS = textwrap.dedent("""
    import sys, psutil, torch
    import zero_offload as zo
    base = psutil.Process().memory_info().rss
    zo.consolidate_checkpoint({root!r}, verify=False)
    # VmHWM: this program's peak; ru_maxrss would count the parent's from before exec
    peak = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024
    print(peak - base)
""")


@pytest.mark.large
def test_consolidation_memory_is_one_copy_of_the_params(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])  # 25M
    params = sum(p.numel() for p in model.parameters())
    engine = zo.initialize(model, stage=2, reduce_bucket_size=5_000_000)
    x = torch.randn(2, 2048)
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.save_checkpoint(tmp_path)  # 12 bytes per param: ~300 MB
    del engine, model
    proc = subprocess.run(
        [sys.executable, "-c", RSS.format(root=str(tmp_path))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    grown = int(proc.stdout.split()[-1])
    largest = 2048 * 2048 * 4
    assert grown <= params * 4 + 1.5 * largest, f"grew {grown / 2**20:.0f} MiB"


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_checkpoint_files_are_plain_data_and_the_rng_streams_come_back(tmp_path):
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), stage=2, lr=1e-2)
    _steps(engine, 0, 1, 0, 1)
    random.seed(3)
    np.random.seed(4)
    folder = engine.save_checkpoint(tmp_path)
    want = _draws()
    for extra in folder.glob("*.pt"):  # no allowlist needed: tensors and plain data only
        torch.load(extra, weights_only=True)
    _draws()
    engine.load_checkpoint(tmp_path)
    got = _draws()
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_extra_file_of_the_previous_version_still_loads(tmp_path):
    """Before, the numpy RNG state was stored as numpy's own tuple with an array in it."""
    engine = zo.initialize(TinyGPT(), stage=1)
    np.random.seed(4)
    folder = engine.save_checkpoint(tmp_path)
    want = np.random.rand()
    path = folder / "rank0.extra.pt"
    extra = torch.load(path, weights_only=True)
    np.random.seed(4)
    extra["rng"]["numpy"] = np.random.get_state()
    torch.save(extra, path)
    np.random.seed(0)
    engine.load_checkpoint(tmp_path)
    assert np.random.rand() == want


class _Payload:
    """What a malicious checkpoint carries: unpickling it calls os.mkdir(marker)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


@pytest.mark.parametrize("reader", ["load_checkpoint", "consolidate"])
def test_poisoned_checkpoint_file_is_refused_and_runs_nothing(tmp_path, reader):
    engine = zo.initialize(TinyGPT(), stage=1)
    folder = engine.save_checkpoint(tmp_path / "ck")
    marker = tmp_path / "payload-ran"
    extra = torch.load(folder / "rank0.extra.pt", weights_only=True)
    extra["lr_scheduler"] = _Payload(marker)
    torch.save(extra, folder / "rank0.extra.pt")
    with pytest.raises(CheckpointError, match=r"rank0\.extra\.pt: refused"):
        if reader == "load_checkpoint":
            engine.load_checkpoint(tmp_path / "ck")
        else:
            zo.consolidate_checkpoint(tmp_path / "ck")
    assert not marker.exists()


@pytest.mark.parametrize(
    "tag",
    [
        "latest",
        "latest.tmp",
        " best",
        "best ",
        "a/b",
        "..",
        ".best",
        "",
        "best.partial",
        "best.replaced",
        "a\\b",
        "tab\there",
        "x" * 201,
        7,
    ],
)
def test_bad_tags_are_refused_before_anything_is_written(tmp_path, tag):
    engine = zo.initialize(TinyGPT(), stage=1)
    with pytest.raises(ValueError, match="cannot name a checkpoint"):
        engine.save_checkpoint(tmp_path / "ck", tag=tag)
    assert not (tmp_path / "ck").exists()
    engine.save_checkpoint(tmp_path / "ck", tag="good")  # later saves are unaffected
    assert engine.load_checkpoint(tmp_path / "ck") == "good"


def _old_and_new(tmp_path):
    """A folder whose tag 'best' (= latest) holds the state after 1 step; the engine is now
    one step further."""
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), stage=2, lr=1e-2)
    _steps(engine, 0, 1, 0, 1)
    engine.save_checkpoint(tmp_path / "template", tag="best")
    old = engine.full_state_dict()
    _steps(engine, 0, 1, 1, 2)
    return engine, old, engine.full_state_dict()


def _loads_old_or_new(folder, old, new, tag=None):
    other = zo.initialize(TinyGPT(), stage=2, lr=1e-2)
    other.load_checkpoint(folder, tag=tag)
    got = other.full_state_dict()
    if all(torch.equal(got[k], new[k]) for k in new):
        return "new"
    assert all(torch.equal(got[k], old[k]) for k in old)
    return "old"


class _Killed(Exception):
    pass


def test_overwriting_a_tag_keeps_a_loadable_checkpoint_at_every_instant(tmp_path, monkeypatch):
    """The save is stopped at each of its renames in turn (as a kill there would stop it):
    the tag and latest load, the old or the new state, and the next save of the tag works."""
    engine, old, new = _old_and_new(tmp_path)
    real = os.replace
    stopped_at = 0
    while True:
        folder = tmp_path / f"stop{stopped_at}"
        shutil.copytree(tmp_path / "template", folder)
        calls = []

        def replace(src, dst, calls=calls, stopped_at=stopped_at):
            calls.append(dst)
            if len(calls) > stopped_at:
                raise _Killed(dst)
            return real(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        try:
            engine.save_checkpoint(folder, tag="best")
            finished = True
        except _Killed:
            finished = False
        monkeypatch.setattr(os, "replace", real)
        assert _loads_old_or_new(folder, old, new) == (
            "new" if finished else _loads_old_or_new(folder, old, new, "best")
        )
        if finished:
            break
        engine.save_checkpoint(folder, tag="best")  # after a stopped save: back to normal
        assert _loads_old_or_new(folder, old, new) == "new"
        assert sorted(os.listdir(folder)) == ["best", "latest"]
        stopped_at += 1
    assert stopped_at >= 5  # rank file, extra file, manifest, two renames of the tag, latest


KILL_BETWEEN_RENAMES = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    import zero_offload as zo
    from support.models import TinyGPT
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), stage=2)
    real = os.replace
    def replace(src, dst):
        if os.path.basename(src) == ".best.partial":  # the second rename of the takeover
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)
    os.replace = replace
    engine.save_checkpoint({root!r}, tag="best")
""")


def test_killed_between_the_renames_of_a_tag_still_loads(tmp_path):
    engine, old, new = _old_and_new(tmp_path)
    root = tmp_path / "template"
    script = KILL_BETWEEN_RENAMES.format(tests=str(Path(__file__).parent), root=str(root))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert sorted(os.listdir(root)) == [".best.partial", ".best.replaced", "latest"]
    for tag in (None, "best"):
        other = zo.initialize(TinyGPT(), stage=2)
        assert other.load_checkpoint(root, tag=tag) == "best"
    assert zo.consolidate_checkpoint(root)  # and consolidation finds it too


class _NumpyStepLR(torch.optim.lr_scheduler.StepLR):
    """Scheduler state with numpy numbers in it, as user code often produces."""

    def state_dict(self):
        return {**super().state_dict(), "best": np.float64(0.25), "history": np.arange(3)}

    def load_state_dict(self, state):
        self.loaded = state
        super().load_state_dict({k: v for k, v in state.items() if k not in ("best", "history")})


class _Opaque:
    pass


def test_scheduler_state_is_stored_as_plain_data_or_refused_before_writing(tmp_path):
    engine = zo.initialize(TinyGPT(), stage=1)
    sched = _NumpyStepLR(engine.optimizer, step_size=1)
    engine.save_checkpoint(tmp_path / "ok", lr_scheduler=sched)
    other = zo.initialize(TinyGPT(), stage=1)
    sched2 = _NumpyStepLR(other.optimizer, step_size=1)
    other.load_checkpoint(tmp_path / "ok", lr_scheduler=sched2)
    assert sched2.loaded["best"] == 0.25 and torch.equal(sched2.loaded["history"], torch.arange(3))
    sched.opaque = _Opaque()  # StepLR.state_dict() carries every attribute
    with pytest.raises(CheckpointError, match="lr_scheduler state holds objects other than"):
        engine.save_checkpoint(tmp_path / "bad", lr_scheduler=sched)
    assert not (tmp_path / "bad").exists()
