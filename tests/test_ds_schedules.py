"""What zero_offload reproduces from DeepSpeed configs, against what DeepSpeed itself computes
(tests/data/deepspeed_reference/reference.json, written by real DeepSpeed with the script
beside it): the lr of each step under its schedules, the fp16 loss scale with hysteresis, the
clipping default. And the engine running them: ``engine.lr_scheduler`` from a config's
``scheduler`` (stepped per applied update, resumed from a checkpoint), a step with inf/NaN
gradients skipped under bf16 (``skip_nonfinite_steps``), an overflow absorbed by hysteresis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.models import batch, loss_fn, make

import zero_offload as zo
from zero_offload.deepspeed_config import lr_scheduler, translate
from zero_offload.update.loss_scale import LossScaler

REF = json.loads(
    (Path(__file__).parent / "data" / "deepspeed_reference" / "reference.json").read_text()
)


@pytest.mark.parametrize("case", REF["schedules"], ids=lambda c: c["section"]["type"])
def test_schedules_run_deepspeeds_learning_rates(case):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=REF["lr"])
    sched = lr_scheduler(opt, {"scheduler": case["section"]})
    got = []
    for _ in case["lrs"]:
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx(case["lrs"], rel=1e-12, abs=1e-15)


def _ours(settings: dict) -> LossScaler:
    return LossScaler(
        settings["init_scale"],
        settings["scale_window"],
        settings["min_scale"],
        hysteresis=settings["delayed_shift"],
        consecutive=settings["consecutive_hysteresis"],
    )


@pytest.mark.parametrize("case", REF["scalers"], ids=lambda c: str(c["settings"]))
def test_loss_scale_follows_deepspeeds_hysteresis(case):
    scaler = _ours(case["settings"])
    got = []
    for overflow in REF["overflows"]:
        scaler.update(bool(overflow))
        got.append(scaler.scale)
    if case["settings"]["scale_window"] > len(REF["overflows"]):
        assert got == case["scales"]  # no growth in the pattern: the same scale at every step
    else:
        # the one documented difference: the scale doubles after `window` overflow-free steps
        # (torch's GradScaler), DeepSpeed's one step later after an overflow
        grow = [i for i in range(1, len(got)) if got[i] > got[i - 1]]
        ds_grow = [i for i in range(1, len(got)) if case["scales"][i] > case["scales"][i - 1]]
        assert grow and [i + 1 for i in grow] == ds_grow


def test_clipping_default_is_deepspeeds():
    assert translate({})["max_grad_norm"] == REF["gradient_clipping_default"] == 1.0


def _train(engine, steps: int, poison: int | None = None) -> list[bool]:
    gen = torch.Generator().manual_seed(1)
    applied = []
    for i in range(steps):
        x, y = batch("gpt", 4, gen)
        loss = loss_fn("gpt", engine(x), y)
        if i == poison:
            loss = loss * float("nan")
        engine.backward(loss)
        applied.append(engine.step())
    return applied


def test_engine_runs_the_configs_schedule_and_resumes_it(tmp_path):
    section = REF["schedules"][2]["section"]  # WarmupDecayLR
    config = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": REF["lr"]}},
        "scheduler": section,
    }
    torch.manual_seed(0)
    engine = zo.initialize(make("gpt"), config=config)
    assert engine.lr_scheduler is not None
    lrs = []
    for _ in range(4):
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        _train(engine, 1)
    assert lrs == pytest.approx(REF["schedules"][2]["lrs"][:4])
    engine.save_checkpoint(tmp_path)
    torch.manual_seed(0)
    again = zo.initialize(make("gpt"), config=config)
    again.load_checkpoint(tmp_path)
    assert again.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(REF["schedules"][2]["lrs"][4])


@pytest.mark.parametrize("stage, offload", [(0, "none"), (3, "cpu")])
def test_bf16_config_skips_a_step_with_nan_gradients(stage, offload):
    config = {
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": offload},
            **({"offload_param": {"device": offload}} if stage == 3 else {}),
        },
        "gradient_clipping": 0,
    }
    torch.manual_seed(0)
    engine = zo.initialize(make("gpt"), config=config, lr=1e-2)
    assert _train(engine, 3, poison=1) == [True, False, True]
    assert engine.skipped_steps == 1
    assert all(torch.isfinite(t).all() for t in engine.full_state_dict().values())
    torch.manual_seed(0)
    unguarded = zo.initialize(make("gpt"), config=config, lr=1e-2, skip_nonfinite_steps=False)
    _train(unguarded, 2, poison=1)
    assert not all(torch.isfinite(t).all() for t in unguarded.full_state_dict().values())


def test_fp16_overflow_absorbed_by_hysteresis():
    config = {"fp16": {"enabled": True, "initial_scale_power": 10}, "gradient_clipping": 0}
    torch.manual_seed(0)
    engine = zo.initialize(make("gpt"), config=config, lr=1e-2)  # hysteresis 2: the default
    _train(engine, 2, poison=0)
    assert engine.skipped_steps == 1 and engine.loss_scale == 2.0**10
    _train(engine, 1, poison=0)
    assert engine.skipped_steps == 2 and engine.loss_scale == 2.0**9


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_schedule_with_a_non_finite_number_is_refused(value):
    """nan passes every range check a schedule's formula makes; refused up front, naming the
    key, before the model is touched."""
    model = torch.nn.Linear(4, 4)
    section = {"type": "WarmupLR", "params": {"warmup_max_lr": value, "warmup_num_steps": 10}}
    with pytest.raises(zo.ConfigError, match="warmup_max_lr"):
        zo.initialize(model, lr_schedule=section)
    assert isinstance(model.weight, torch.nn.Parameter) and model.weight.is_leaf
