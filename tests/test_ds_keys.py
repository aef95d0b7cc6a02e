"""The decision table of ``zero_offload.deepspeed_config.table`` is what ``translate`` does: every
key (and
each of DeepSpeed's other names for it) is translated, accepted with one log line, or refused
with a ConfigError naming it (accepted at the values that leave its feature off); the
DeepSpeed-migration docs page is that table; and DeepSpeed's sentinels and defaults behave as
in DeepSpeed."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import zero_offload as zo
from zero_offload.deepspeed_config import translate
from zero_offload.deepspeed_config.table import KEYS, Decision, counts, markdown

DOCS = Path(__file__).resolve().parents[1] / "docs" / "deepspeed.md"
BEGIN = "<!-- decisions: generated from zero_offload/deepspeed_config/ -->"
END = "<!-- /decisions -->"


def _nest(path: str, value: Any) -> dict:
    out: dict = {}
    node = out
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _names(decision: Decision) -> list[tuple[str, Any]]:
    return [(n, k) for k in KEYS if k.decision is decision for n in (k.path, *k.aliases)]


def test_the_docs_page_is_the_table():
    text = DOCS.read_text()
    assert BEGIN in text and END in text
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip() + "\n"
    assert table == markdown(), (
        "docs/deepspeed.md is out of date: replace its decisions block with "
        "zero_offload.deepspeed_config.table.markdown()"
    )
    c = counts()
    assert sum(c.values()) == len(KEYS) and min(c.values()) > 0


@pytest.mark.parametrize("name, key", _names(Decision.ACCEPTED), ids=lambda v: str(v))
def test_accepted_keys_log_why_once(name, key, caplog):
    with caplog.at_level(logging.INFO, logger="zero_offload.deepspeed_config"):
        translate({**_nest(name, {"enabled": True, "x": 1}), "steps_per_print": 1})
    lines = [r.getMessage() for r in caplog.records if repr(name) in r.getMessage()]
    assert lines == [f"DeepSpeed config key {name!r} is not needed: {key.why}"]


def _refused_value(key) -> Any:
    if not key.off:
        return {"enabled": True, "x": 1}
    return next(
        v for v in (True, False, 2, "sum") if v not in key.off and type(v) is type(key.off[0])
    )


@pytest.mark.parametrize("name, key", _names(Decision.REFUSED), ids=lambda v: str(v))
def test_refused_keys_name_the_key_and_accept_off(name, key, caplog):
    with pytest.raises(zo.ConfigError, match="not supported") as err:
        translate(_nest(name, _refused_value(key)))
    assert repr(name) in str(err.value) and key.why in str(err.value)
    off = key.off[0] if key.off else {"enabled": False, "x": 1}
    with caplog.at_level(logging.INFO, logger="zero_offload.deepspeed_config"):
        translate(_nest(name, off))
    assert any(f"{name!r} is off" in r.getMessage() for r in caplog.records)


def _every_translated_key(precision: str) -> dict:
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-4,
                "betas": [0.8, 0.9],
                "eps": 1e-6,
                "weight_decay": 0.1,
                "adam_w_mode": True,
                "torch_adam": False,
            },
        },
        precision: {"enabled": True}
        if precision != "fp16"
        else {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 50,
            "min_loss_scale": 2,
            "hysteresis": 3,
            "consecutive_hysteresis": True,
        },
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {
            "stage": 3,
            "cpu_offload": True,
            "cpu_offload_param": True,
            "offload_optimizer": {"device": "cpu", "nvme_path": "/unused"},
            "offload_param": {"device": "cpu", "nvme_path": "/unused"},
            "sub_group_size": 0,
            "reduce_bucket_size": 100,
            "stage3_prefetch_bucket_size": 10,
            "stage3_param_persistence_threshold": 7,
        },
    }


def test_every_translated_key_becomes_keywords():
    """One config holding every translated key: each is read (translate asserts that a
    translated key it did not read cannot pass) and lands where the table says."""
    fp16 = translate(_every_translated_key("fp16"), world=1)
    assert fp16 == dict(
        dtype="float16",
        initial_loss_scale=2.0**12,
        loss_scale_window=50,
        min_loss_scale=2.0,
        loss_scale_hysteresis=3,
        consecutive_hysteresis=True,
        stage=3,
        offload_optimizer="cpu",
        offload_param="cpu",
        reduce_bucket_size=100,
        param_persistence_threshold=7,
        prefetch_bytes=20,  # 10 elements of 2 bytes
        lr=1e-4,
        eps=1e-6,
        weight_decay=0.1,
        betas=(0.8, 0.9),
        gradient_accumulation_steps=4,
        max_grad_norm=0.5,
    )
    cfg = zo.build_config(fp16)
    assert cfg.precision.loss_scale_hysteresis == 3 and cfg.offload.sub_group_size == 100_000_000
    bf16 = translate({**_every_translated_key("bfloat16"), "data_types": {}}, world=1)
    assert bf16["dtype"] == "bfloat16" and bf16["skip_nonfinite_steps"] is True
    assert bf16["prefetch_bytes"] == 20
    translated = {n for n, _ in _names(Decision.TRANSLATED)}
    assert "scheduler" in translated  # run by the trainer integrations (test_ds_schedules.py)


def test_aliases_are_one_key():
    assert translate(_nest("zero_optimization.max_live_parameters", 0)) == translate(
        _nest("zero_optimization.stage3_max_live_parameters", 0)
    )
    both = {"zero_optimization": {"prefetch_bucket_size": 5, "stage3_prefetch_bucket_size": 6}}
    with pytest.raises(zo.ConfigError, match="under two of its names"):
        translate(both)
    old = {"bfloat16": {"enabled": True}}
    assert translate(old)["dtype"] == "bfloat16"


def test_auto_and_sentinels_as_in_deepspeed(caplog):
    # "auto" in a section DeepSpeed validates: its default; elsewhere a keyword fills it
    with caplog.at_level(logging.INFO, logger="zero_offload.deepspeed_config"):
        kw = translate({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert "reduce_bucket_size" not in kw and any(
        '"auto"' in r.getMessage() for r in caplog.records
    )
    assert "sub_group_size" not in translate(_nest("zero_optimization.sub_group_size", 0))
    auto = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "fp16": {"enabled": "auto"}}
    with pytest.raises(zo.ConfigError, match="or pass lr= to initialize"):
        translate(auto)
    cfg = zo.build_config(auto, lr=0.5, dtype="float16")
    assert cfg.optimizer.lr == 0.5 and cfg.precision.loss_scale_hysteresis == 2
    # absent: DeepSpeed's defaults where they change training
    assert translate({"zero_optimization": {"stage": 1}})["max_grad_norm"] == 1.0
    assert translate({"gradient_clipping": 0})["max_grad_norm"] is None
    assert translate({"optimizer": {"type": "AdamW"}})["weight_decay"] == 0.0


def test_batch_keys_give_the_accumulation_deepspeed_derives():
    assert (
        translate({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world=2)[
            "gradient_accumulation_steps"
        ]
        == 4
    )
    assert translate({"train_batch_size": 32}, world=2)["gradient_accumulation_steps"] == 1
    with pytest.raises(zo.ConfigError, match="world size 2"):
        translate({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world=2)


def test_unknown_keys_as_deepspeed_treats_them(caplog):
    with caplog.at_level(logging.WARNING, logger="zero_offload.deepspeed_config"):
        kw = translate(
            {"zero_optimization": {"stage": 2}, "cuda_visible_devices": 0, "_comment": "x"}
        )
    assert kw["stage"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        "DeepSpeed config key 'cuda_visible_devices' is not one DeepSpeed reads: ignored, "
        "as DeepSpeed ignores it"
    ]
    with pytest.raises(zo.ConfigError, match="did you mean 'zero_optimization.reduce_bucket_size'"):
        translate({"zero_optimization": {"reduce_buket_size": 5}})


# What DeepSpeed 0.19.8 builds for each section (engine._configure_basic_optimizer, run in the
# DeepSpeed venv): type AdamW is AdamW whatever adam_w_mode says; torch_adam picks
# torch.optim.AdamW (weight_decay default 0.01) or, for Adam with adam_w_mode false,
# torch.optim.Adam (default 0).
@pytest.mark.parametrize(
    "params, ds_type, kind, decay",
    [
        ({"torch_adam": True}, "AdamW", "adamw", 0.01),
        ({"adam_w_mode": False}, "AdamW", "adamw", 0.0),
        ({"adam_w_mode": False, "torch_adam": True}, "AdamW", "adamw", 0.01),
        ({"torch_adam": True}, "Adam", "adamw", 0.01),
        ({"adam_w_mode": False, "torch_adam": True}, "Adam", "adam", 0.0),
        ({"adam_w_mode": False}, "Adam", "adam", 0.0),
    ],
)
def test_adam_sections_build_what_deepspeed_builds(params, ds_type, kind, decay):
    kw = translate({"optimizer": {"type": ds_type, "params": {"lr": 1e-3, **params}}})
    assert kw.get("optimizer_type", "adamw") == kind
    assert kw["weight_decay"] == decay


@pytest.mark.parametrize(
    "ds_type, key, value",
    [
        ("Lion", "eps", 1e-8),
        ("Lion", "adam_w_mode", False),
        ("Lion", "torch_adam", True),
        ("Adagrad", "betas", [0.9, 0.99]),
        ("Adagrad", "torch_adam", True),
    ],
)
def test_keys_deepspeed_s_class_does_not_take_are_named(ds_type, key, value):
    """DeepSpeed passes them to DeepSpeedCPULion / DeepSpeedCPUAdagrad, whose constructors
    raise TypeError."""
    section = {"type": ds_type, "params": {"lr": 1e-3, key: value}}
    with pytest.raises(zo.ConfigError, match=rf"'optimizer\.params\.{key}'.*{ds_type}.*remove"):
        translate({"optimizer": section})


@pytest.mark.parametrize(
    "path, value",
    [
        ("zero_optimization.compute_grad_norm", False),  # DeepSpeed 0.19.8 ZeRO 1-2 options
        ("zero_optimization.compute_grad_norm", True),
        ("zero_optimization.parameter_alignment", True),
        ("optimizer.params.fp32_optimizer_states", True),  # DeepSpeedCPUAdam's default
        ("optimizer.params.set_grad_none", True),  # FusedAdam / FusedLion
        ("optimizer.params.set_grad_none", False),
    ],
)
def test_keys_deepspeed_0_19_8_reads_are_known(path, value, caplog):
    config = {**_nest(path, value), "zero_optimization": {"stage": 2}}
    if path.startswith("zero"):
        config = _nest(path, value)
        config["zero_optimization"]["stage"] = 2
    with caplog.at_level(logging.INFO, logger="zero_offload.deepspeed_config"):
        translate(config)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "not a DeepSpeed key" not in logged and repr(path) in logged


def test_cpu_adam_moments_in_the_parameter_dtype_point_to_moment_precision():
    section = {"type": "AdamW", "params": {"lr": 1e-3, "fp32_optimizer_states": False}}
    with pytest.raises(zo.ConfigError, match=r"fp32_optimizer_states.*moment_precision='bf16'"):
        translate({"optimizer": section})
