"""DeepSpeed checkpoints written by real DeepSpeed 0.19.8 (tests/data/deepspeed, made by its
make_fixtures.py) resume in zero_offload:
- ZeRO stages 1, 2, 3 saved on 1 and 2 ranks load at world 1, 2 and 4 (optimizer on device,
  host and NVMe): the fp32 masters are exactly DeepSpeed's own reading of them (zero_to_fp32),
  and three more steps end where DeepSpeed's own three more steps ended, to the tolerance of
  the torch-AdamW equivalence tests (clipping binds on both sides);
- ``zero-offload import-deepspeed`` writes the same state in this library's format;
- the files are unpickled with weights_only and DeepSpeed's classes as inert stand-ins: a file
  holding anything else is refused and runs nothing; incomplete saves are named;
- an fp16 run's dynamic loss scale comes back;
- ``ZeroOffloadTrainer(resume_from_checkpoint=...)`` resumes a Trainer checkpoint saved by a
  DeepSpeed ZeRO-2 run and ends where that run ended.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.distributed import run_ranks
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.checkpoint import CheckpointError
from zero_offload.checkpoint.deepspeed import DeepSpeedSource, load_deepspeed_file

DATA = Path(__file__).parent / "data" / "deepspeed"
FIXTURES = [f"s{s}w{w}" for s in (1, 2, 3) for w in (1, 2)] + ["s3w2-cpu"]  # -cpu: ZeRO-Offload
OFFLOAD = {1: "none", 2: "cpu", 4: "nvme"}


def _run(case: str) -> dict:
    return json.loads((DATA / case / "run.json").read_text())


def _engine(run: dict, **kw) -> zo.Engine:
    model = TinyGPT(width=run["width"])
    for name in run["frozen"]:
        model.get_parameter(name).requires_grad_(False)
    return zo.initialize(
        model,
        stage=run["stage"],
        lr=run["lr"],
        weight_decay=run["weight_decay"],
        max_grad_norm=run["clip"],
        no_decay=[n for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2],
        **kw,
    )


def _resume_all(rank: int, world: int, nvme: str) -> dict:
    """Each fixture: load, compare with DeepSpeed's masters, continue, report."""
    out = {}
    for case in FIXTURES:
        run = _run(case)
        torch.manual_seed(7)  # not the fixture's init: everything must come from the files
        engine = _engine(run, offload_optimizer=OFFLOAD[world], nvme_path=nvme)
        tag = engine.load_checkpoint(DATA / case)
        loaded = engine.full_state_dict()
        steps = (engine.optimizer_steps, engine.global_steps)
        per = run["global_batch"] // world
        for i in range(run["save_at"], run["steps"]):
            x, y = batch("gpt", run["global_batch"], torch.Generator().manual_seed(100 + i))
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            engine.backward(loss_fn("gpt", engine(x), y))
            engine.step()
        out[case] = dict(tag=tag, loaded=loaded, steps=steps, end=engine.full_state_dict())
        engine.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 4])
def test_deepspeed_checkpoints_continue_where_deepspeed_did(world, tmp_path):
    results = run_ranks(world, _resume_all, str(tmp_path))[0]
    for case in FIXTURES:
        run, r = _run(case), results[case]
        assert r["tag"] == f"global_step{run['save_at']}"
        assert r["steps"] == (run["save_at"], run["save_at"])
        assert min(run["grad_norms"]) > run["clip"], "clipping must bind on both sides"
        masters = load_file(DATA / case / "masters.safetensors")
        for name, value in masters.items():  # what DeepSpeed's zero_to_fp32 reads
            assert torch.equal(r["loaded"][name], value), (case, name)
        assert torch.equal(r["loaded"]["lm_head.weight"], r["loaded"]["wte.weight"])  # tied
        expected = load_file(DATA / case / "expected.safetensors")
        frozen = run["frozen"][0]
        assert torch.equal(r["end"][frozen], r["loaded"][frozen])
        if frozen in expected:  # DeepSpeed lists frozen parameters from stage 2 on
            assert torch.equal(r["end"][frozen], expected[frozen])
        diffs = torch.cat([(r["end"][n] - v).abs().flatten() for n, v in expected.items()])
        assert diffs.max().item() / run["lr"] <= 0.03, (case, diffs.max().item() / run["lr"])
        assert diffs.mean().item() <= 1e-6, case


def test_import_deepspeed_cli_writes_the_same_state(tmp_path, capsys):
    from zero_offload.cli import main

    case = "s3w2"
    assert main(["import-deepspeed", str(DATA / case), str(tmp_path / "zo")]) == 0
    assert "global_step3" in capsys.readouterr().out
    consolidated = zo.consolidate_checkpoint(tmp_path / "zo")
    for name, value in load_file(DATA / case / "masters.safetensors").items():
        assert torch.equal(consolidated[name], value), name
    run = _run(case)
    direct, imported = _engine(run), _engine(run)
    direct.load_checkpoint(DATA / case)
    assert imported.load_checkpoint(tmp_path / "zo") == "global_step3"
    for engine in (direct, imported):
        x, y = batch("gpt", 8, torch.Generator().manual_seed(103))
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
    a, b = direct.full_state_dict(), imported.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert direct.optimizer_steps == imported.optimizer_steps == 4
    direct.close()
    imported.close()
    assert main(["import-deepspeed", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1
    assert "not a DeepSpeed checkpoint" in capsys.readouterr().err


def _copy(case: str, tmp_path: Path) -> Path:
    shutil.copytree(DATA / case, tmp_path / case)
    return tmp_path / case


def _rewrite(path: Path, state: dict) -> None:
    """A new file in place of the old (whose memory-mapped tensors ``state`` still holds)."""
    torch.save(state, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)


def test_a_file_holding_other_objects_is_refused_and_runs_nothing(tmp_path):
    folder = _copy("s1w1", tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    optim = folder / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = load_deepspeed_file(optim)
    state["optimizer_state_dict"]["clip_grad"] = Payload()
    _rewrite(optim, state)
    engine = _engine(_run("s1w1"))
    with pytest.raises(CheckpointError, match="refused.*could run code"):
        engine.load_checkpoint(folder)
    assert not marker.exists()
    engine.close()


def test_incomplete_and_unsupported_saves_are_named(tmp_path):
    run = _run("s2w2")
    engine = _engine(run)
    folder = _copy("s2w2", tmp_path)
    (folder / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks .* ranks \[1\] are missing"):
        engine.load_checkpoint(folder)
    (folder / "global_step3" / "offloaded_tensors").mkdir()
    with pytest.raises(CheckpointError, match="NVMe swap files"):
        engine.load_checkpoint(folder)
    engine.close()
    other = zo.initialize(TinyGPT(width=16, layers=1), stage=2)
    with pytest.raises(CheckpointError, match=r"not in the model: \['blocks\.1\."):
        other.load_checkpoint(DATA / "s2w1")
    other.close()


def _fake_deepspeed_scaler(monkeypatch) -> type:
    """A class pickled under DeepSpeed's name, as an fp16 DeepSpeed run stores its scaler
    (this host's DeepSpeed CPU accelerator has no fp16, so no real fixture has one)."""
    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16"]
    for name in names + ["deepspeed.runtime.fp16.loss_scaler"]:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = sys.modules["deepspeed.runtime.fp16.loss_scaler"]
    cls = type("DynamicLossScaler", (), {"__module__": module.__name__})
    module.DynamicLossScaler = cls  # type: ignore[attr-defined]
    return cls


def test_fp16_dynamic_loss_scale_comes_back(tmp_path, monkeypatch):
    folder = _copy("s2w1", tmp_path)
    optim = folder / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = load_deepspeed_file(optim)
    osd = state["optimizer_state_dict"]
    osd.pop("param_slice_mappings")  # stand-in records of their own, not needed here
    with monkeypatch.context() as patch:
        scaler = _fake_deepspeed_scaler(patch)()
        scaler.__dict__.update(
            cur_scale=512.0,
            cur_iter=3,
            last_overflow_iter=1,
            scale_window=1000,
            delayed_shift=2,
            cur_hysteresis=1,  # the overflow at iteration 1 used one of delayed_shift 2
            dynamic=True,
        )
        osd["loss_scaler"] = scaler
        _rewrite(optim, state)
    engine = _engine(_run("s2w1"), dtype=torch.float16)
    engine.load_checkpoint(folder)
    # DeepSpeed doubles when (cur_iter - last_overflow_iter) % window == 0: 1 good step so far
    assert engine.training_state()["loss_scaler"] == {
        "scale": 512.0,
        "good_steps": 1,
        "skipped_steps": 0,
        "hysteresis_left": 1,
    }
    engine.close()


@pytest.mark.parametrize("case", ["hf", "hf-dsched"])
def test_trainer_resumes_a_checkpoint_saved_by_a_deepspeed_trainer_run(case, tmp_path):
    """``hf``: Trainer's own lr schedule (its scheduler.pt); ``hf-dsched``: the config's
    WarmupDecayLR, which DeepSpeed ran and kept in its checkpoint."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(DATA))
    try:
        import hf_fixture as hf
    finally:
        sys.path.remove(str(DATA))
    from zero_offload.integrations.hf import ZeroOffloadTrainer

    ds = json.loads((DATA / case / "run.json").read_text())
    shutil.copytree(DATA / case / f"checkpoint-{hf.SAVE_AT}", tmp_path / "checkpoint")
    trainer = ZeroOffloadTrainer(
        model=hf.make_model(),
        args=hf.arguments(tmp_path / "out", save_strategy="no"),
        train_dataset=hf.dataset(),
        zero_offload=ds["config"],  # the DeepSpeed run's own config file
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint"))
    assert trainer.lr_scheduler.last_epoch == hf.STEPS  # the schedule went on from step 3
    got = trainer.engine.full_state_dict()
    trainer.engine.close()
    expected = load_file(DATA / case / "expected.safetensors")
    worst = max((got[n] - v).abs().max().item() for n, v in expected.items()) / hf.LR
    assert worst <= 0.03, f"max |diff| = {worst:.4f} lr"
    logged = [h for h in trainer.state.log_history if "loss" in h and h["step"] > hf.SAVE_AT]
    assert [h["step"] for h in logged] == list(range(hf.SAVE_AT + 1, hf.STEPS + 1))
    after = slice(hf.SAVE_AT, None)
    for h, loss, norm, lr in zip(
        logged, ds["losses"][after], ds["grad_norms"][after], ds["learning_rates"][after]
    ):
        assert h["loss"] == pytest.approx(loss, abs=1e-3)  # Trainer logs 4 significant digits
        assert h["grad_norm"] == pytest.approx(norm, rel=1e-3)
        if case == "hf":  # under DeepSpeed, Trainer logs a DeepSpeed schedule's next lr
            assert h["learning_rate"] == pytest.approx(lr, rel=1e-6)


BF16 = [f"s{s}w2-bf16" for s in (1, 2, 3)]  # bf16_zero_pp_rank_* files, ordinary ZeRO state


@pytest.mark.parametrize("case", BF16)
def test_a_bf16_run_loads_at_every_stage(case, tmp_path):
    """DeepSpeed 0.19.8 names every bf16 run's optimizer files ``bf16_zero_pp_rank_*``."""
    run = _run(case)
    assert run["config"]["bf16"] == {"enabled": True}
    engine = _engine(run)
    assert engine.load_checkpoint(DATA / case) == "global_step3"
    loaded = engine.full_state_dict()
    for name, value in load_file(DATA / case / "masters.safetensors").items():
        assert torch.equal(loaded[name], value), name
    assert engine.optimizer_steps == run["save_at"]
    engine.close()
    # masters and moments read as the same files under the non-bf16 names read
    folder = _copy(case, tmp_path)
    for path in (folder / "global_step3").glob("bf16_*"):
        path.rename(path.with_name(path.name.removeprefix("bf16_")))
    bf16, plain = (
        DeepSpeedSource(DATA / case / "global_step3"),
        DeepSpeedSource(folder / "global_step3"),
    )
    assert bf16.stage == plain.stage == run["stage"] and bf16.policy == plain.policy
    for name, shape in bf16.shapes.items():
        got = [torch.zeros(math.prod(shape)) for _ in range(3)]
        want = [torch.zeros(math.prod(shape)) for _ in range(3)]
        bf16.read(name, 0, got[0].numel(), got)
        plain.read(name, 0, want[0].numel(), want)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name


def test_the_bf16_optimizer_without_zero_is_refused_by_name(tmp_path):
    folder = _copy("s2w2-bf16", tmp_path)
    for path in (folder / "global_step3").glob("bf16_*optim_states.pt"):
        state = load_deepspeed_file(path)
        osd = state["optimizer_state_dict"]
        del osd["zero_stage"]  # BF16_Optimizer's layout has none
        for key in ("param_slice_mappings", "loss_scaler"):  # stand-in records, not needed
            osd.pop(key, None)
        _rewrite(path, state)
    engine = _engine(_run("s2w2-bf16"))
    with pytest.raises(CheckpointError, match=r"BF16_Optimizer.*stage 0.*stage 1, 2 or 3"):
        engine.load_checkpoint(folder)
    engine.close()


def test_an_adam_l2_run_resumes_under_the_engine_its_config_builds():
    """``Adam`` with ``adam_w_mode: false``: DeepSpeed built torch.optim.Adam (L2 decay, its
    param groups say ``decoupled_weight_decay: False``); the same config builds
    optimizer_type='adam', and the checkpoint loads into it and goes on as DeepSpeed did."""
    case = "s3w1-adaml2"
    run = _run(case)
    model = TinyGPT(width=run["width"])
    model.get_parameter(run["frozen"][0]).requires_grad_(False)
    engine = zo.initialize(model, config=run["config"])
    assert engine.state_policy.kind.value == "adam"
    assert engine.load_checkpoint(DATA / case) == "global_step3"
    loaded = engine.full_state_dict()
    for name, value in load_file(DATA / case / "masters.safetensors").items():
        assert torch.equal(loaded[name], value), name
    for i in range(run["save_at"], run["steps"]):
        x, y = batch("gpt", run["global_batch"], torch.Generator().manual_seed(100 + i))
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
    end = engine.full_state_dict()
    engine.close()
    expected = load_file(DATA / case / "expected.safetensors")
    diffs = torch.cat([(end[n] - v).abs().flatten() for n, v in expected.items()])
    assert diffs.max().item() / run["lr"] <= 0.03 and diffs.mean().item() <= 1e-6
    adamw = _engine(run)  # a run kept as Adam is not silently resumed as AdamW
    with pytest.raises(CheckpointError, match="optimizer_type='adam'"):
        adamw.load_checkpoint(DATA / case)
    adamw.close()


@pytest.mark.parametrize(
    "state, groups, config, kind",
    [
        ({"exp_avg": 0, "exp_avg_sq": 0}, [{"decoupled_weight_decay": False}], {}, "adam"),
        ({"exp_avg": 0, "exp_avg_sq": 0}, [{"decoupled_weight_decay": True}], {}, "adamw"),
        ({"exp_avg": 0, "exp_avg_sq": 0}, None, {"type": "Adam"}, "adamw"),  # adam_w_mode
        ({"exp_avg": 0, "exp_avg_sq": 0}, None, {"type": "AdamW"}, "adamw"),
        (
            {"exp_avg": 0, "exp_avg_sq": 0},
            None,
            {"type": "Adam", "params": {"adam_w_mode": False}},
            "adam",
        ),
        ({"exp_avg": 0}, None, {"type": "Lion"}, "lion"),  # DeepSpeedCPULion, FusedLion
        ({"exp_avg_sq": 0}, None, {"type": "Adagrad"}, "adagrad"),  # DeepSpeedCPUAdagrad
        ({"sum": 0}, [{}], {}, "adagrad"),  # torch.optim.Adagrad
        ({"exp_avg": 0, "exp_avg_sq": 0}, [{}], {}, "adamw"),  # DeepSpeedCPUAdam: unknown
    ],
)
def test_the_saved_update_rule_is_read_from_the_checkpoint(state, groups, config, kind):
    from zero_offload.checkpoint.deepspeed_state import saved_kind

    assert saved_kind({0: state}, groups, {"optimizer": config}).value == kind


def test_a_damaged_save_is_named_as_damaged(tmp_path):
    """A truncated file (an interrupted copy, a full disk) is not a security refusal; a stage
    1-2 folder that lost its model states file is still recognised as DeepSpeed's."""
    engine = _engine(_run("s2w2"))
    folder = _copy("s2w2", tmp_path)
    optim = folder / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"rank_1_.*truncated or corrupt") as err:
        engine.load_checkpoint(folder)
    assert "could run code" not in str(err.value)
    shutil.rmtree(folder)
    folder = _copy("s2w2", tmp_path)
    (folder / "global_step3" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt: missing") as err:
        engine.load_checkpoint(folder)
    assert "manifest.json" not in str(err.value)
    engine.close()
