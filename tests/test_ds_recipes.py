"""Real DeepSpeed recipe files, kept verbatim under tests/data/ds_configs/ (each with its
repository, path and commit in the ``.source`` file beside it), used with no edit:
- through ``initialize`` (``config=`` the file; its "auto" values filled by the keywords of the
  same meaning, as a trainer would fill them), training 2 steps of an own loop;
- through ``ZeroOffloadTrainer`` (``zero_offload=`` the file), 2 steps of a tiny Llama, with
  TrainingArguments that agree with the file's fixed values (as Hugging Face's DeepSpeed
  integration requires), the learning rate the file's DeepSpeed schedule gives: ten files
  covering every repository, stage, offload target and precision among them (the Trainer's
  start-up is what costs);
- through ``ZeroOffloadStrategy`` (``config=`` the file), 2 steps in one spawned process for
  all of them (lightning_recipes_worker.py).
Each run checks the engine got the stage, offload targets and dtype the file asks for."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from support.models import batch, loss_fn, make

import zero_offload as zo
from zero_offload.deepspeed_config import translate

HERE = Path(__file__).parent
RECIPES = sorted((HERE / "data" / "ds_configs").glob("*.json"))
NAMES = [p.stem for p in RECIPES]
# TrainingArguments agreeing with a file's fixed values (Trainer refuses a disagreement),
# for the files trained through ZeroOffloadTrainer
TRAINER_ARGS: dict[str, dict] = {
    "axolotl-zero1": {},
    "axolotl-zero3_bf16_cpuoffload_all": dict(bf16=True),
    "axolotl-zero3_bf16_cpuoffload_params": dict(bf16=True),
    "transformers-ds_config_zero3": dict(
        fp16=True,
        learning_rate=3e-5,
        adam_beta1=0.8,
        weight_decay=3e-7,
        warmup_steps=500,
    ),
    "deepspeedexamples-imagenet": dict(
        per_device_train_batch_size=256,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        adam_beta1=0.8,
        weight_decay=3e-7,
        max_grad_norm=0.0,
    ),
    "llamafactory-ds_z0_config": {},
    "llamafactory-ds_z2_offload_config": {},
    "llamafactory-ds_z3_fp8_config": {},
    "ms-swift-zero3": {},
    "transformers-ds_config_zero2_bf16": {},
}
# keywords filling a file's "auto" values when it goes through initialize
KEYWORDS = dict(
    lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, gradient_accumulation_steps=2,
    max_grad_norm=1.0,
)  # fmt: skip
# a schedule whose values are all "auto" (a Trainer's to fill) takes them from lr_schedule=
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_num_steps": 10}}
AUTO_KEYS = {
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "eps": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_grad_norm": "gradient_clipping",
}


def _load(name: str) -> dict:
    return json.loads((HERE / "data" / "ds_configs" / f"{name}.json").read_text())


def _dig(data: dict, path: str):
    for part in path.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _expected(name: str, **resolve) -> dict:
    """Stage, offload targets and dtype the file asks for (``resolve``: the "auto" values that
    matter for them, the rest filled with anything)."""
    filler = {AUTO_KEYS[k]: v for k, v in KEYWORDS.items()}
    filler.update(train_batch_size=None, train_micro_batch_size_per_gpu=None)
    kw = translate(_load(name), {**filler, **resolve}, trainer="a test", world=1)
    return {
        "stage": kw.get("stage", 0),
        "offload_optimizer": kw.get("offload_optimizer", "none"),
        "offload_param": kw.get("offload_param", "none"),
        "dtype": str(kw.get("dtype", "float32")),
    }


def _got(engine) -> dict:
    cfg = engine.config
    return {
        "stage": cfg.stage,
        "offload_optimizer": cfg.offload.optimizer,
        "offload_param": cfg.offload.param,
        "dtype": str(cfg.dtype).removeprefix("torch."),
    }


def test_recipes_are_kept_with_their_source():
    assert len(RECIPES) >= 10
    for path in RECIPES:
        json.loads(path.read_text())
        source = path.with_suffix(".source").read_text()
        assert re.search(r"^repository: https://github.com/\S+/\S+$", source, re.M), path
        assert re.search(r"^path: \S+\.json$", source, re.M), path
        assert re.search(r"^commit: [0-9a-f]{40}$", source, re.M), path


@pytest.mark.parametrize("name", NAMES)
def test_recipe_through_initialize(name, tmp_path):
    config = _load(name)
    keywords: dict = {k: v for k, v in KEYWORDS.items() if _dig(config, AUTO_KEYS[k]) == "auto"}
    if "auto" in (_dig(config, "scheduler.params") or {}).values():
        keywords["lr_schedule"] = SCHEDULE
    torch.manual_seed(0)
    model = make("gpt")
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = HERE / "data" / "ds_configs" / f"{name}.json"
    engine = zo.initialize(model, config=str(path), **keywords)
    assert _got(engine) == _expected(name)
    gen = torch.Generator().manual_seed(1)
    lrs = []
    while engine.global_steps < 2:
        if engine.is_accumulation_boundary:
            lrs.append(engine.optimizer.param_groups[0]["lr"])
        x, y = batch("gpt", 1, gen)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
    got = engine.full_state_dict()
    engine.close()
    assert all(torch.isfinite(t).all() for t in got.values())
    moved = max((got[k].float() - start[k].float()).abs().max().item() for k in start)
    assert moved > 0 or max(lrs) == 0.0  # a DeepSpeed warmup starts at warmup_min_lr


# -- ZeroOffloadTrainer ------------------------------------------------------------------------


def _trainer_run(name: str, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    from hf_trainer_worker import arguments
    from hf_trainer_worker import make as make_hf

    from zero_offload.integrations.hf import ZeroOffloadTrainer

    kw = {"max_steps": 2, "gradient_accumulation_steps": 1, **TRAINER_ARGS[name]}
    args = arguments(str(tmp_path), **kw)
    n = args.per_device_train_batch_size * args.gradient_accumulation_steps * 2
    ids = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ZeroOffloadTrainer(
            model=make_hf("llama"),
            args=args,
            train_dataset=[{"input_ids": x, "labels": x} for x in ids],
            zero_offload=str(HERE / "data" / "ds_configs" / f"{name}.json"),
        )
        trainer.train()
    assert isinstance(trainer, transformers.Trainer)
    return trainer, args


@pytest.mark.parametrize("name", sorted(TRAINER_ARGS))
def test_recipe_through_zero_offload_trainer(name, tmp_path):
    trainer, args = _trainer_run(name, tmp_path)
    engine = trainer.engine
    try:
        auto = {
            "fp16.enabled": bool(args.fp16),
            "bf16.enabled": bool(args.bf16),
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "gradient_clipping": args.max_grad_norm,
        }
        assert _got(engine) == _expected(name, **auto)
        assert trainer.state.global_step == 2 and engine.global_steps + engine.skipped_steps == 2
        logged = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logged) == 2 and all(h["loss"] == h["loss"] for h in logged)  # not NaN
        scheduler = _load(name).get("scheduler")
        if scheduler is not None:  # the file's DeepSpeed schedule, not lr_scheduler_type
            assert type(trainer.lr_scheduler).__name__ == "DeepSpeedSchedule"
            assert trainer.lr_scheduler.kind == scheduler["type"]
            assert [h["learning_rate"] for h in logged] == [0.0, 0.0]  # DeepSpeed's log warmup
    finally:
        engine.close()


REFUSED = {  # real files asking for what zero_offload cannot honour: the key named
    "deepspeedexamples-bingbertsquad_bsz24": "optimizer.params.bias_correction",
    "deepspeedexamples-bf16_full": "bf16.bf16_master_weights_and_grads",
    "llamafactory-ds_z2_autotp_config": "tensor_parallel.autotp_size",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_recipes_asking_for_what_cannot_be_honoured_are_refused(name):
    path = HERE / "data" / "ds_configs" / "refused" / f"{name}.json"
    assert re.search(r"^commit: [0-9a-f]{40}$", path.with_suffix(".source").read_text(), re.M)
    keywords = dict(lr=1e-3, gradient_accumulation_steps=1, max_grad_norm=1.0)
    with pytest.raises(zo.ConfigError, match="not supported") as err:
        zo.build_config(str(path), **keywords)
    assert repr(REFUSED[name]) in str(err.value)
