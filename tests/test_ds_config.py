"""DeepSpeed JSON configs taken by ``initialize`` and ``zero-offload convert-config``, read as
DeepSpeed reads them (the decision table of ``zero_offload.deepspeed_config.table``): the keys
that mean something here map to the same engine settings, the ones this library does not need are
accepted with one log line each, the ones it cannot honour are a ConfigError naming the key,
DeepSpeed's aliases, sentinels ("auto", ``sub_group_size: 0``) and defaults (clipping at 1.0,
hysteresis 2) behave as there, and the batch keys give the accumulation DeepSpeed derives.

The recipe dicts here are the transformers configs as their repository ships them (only
``nvme_path`` is pointed at a temporary folder); tests/test_ds_recipes.py trains the recipe
files of tests/data/ds_configs."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from support.models import batch, loss_fn, make

import zero_offload as zo
from zero_offload.cli import main
from zero_offload.deepspeed_config import translate

# Hugging Face transformers, tests/deepspeed/ds_config_zero2.json ("auto": filled by Trainer)
HF_ZERO2 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# Hugging Face transformers, tests/deepspeed/ds_config_zero3.json
HF_ZERO3 = {
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e14,
        "reduce_bucket_size": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_fp16_weights_on_model_save": True,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500},
    },
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}

# Hugging Face transformers docs, DeepSpeed guide: ZeRO-3 with NVMe offload
HF_ZERO3_NVME = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# What Hugging Face Trainer fills in for "auto" (TrainingArguments defaults, hidden size 64).
TRAINER_AUTO = {
    "fp16.enabled": False,
    "bf16.enabled": False,
    "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "zero_optimization.reduce_bucket_size": 64 * 64,
    "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
    "zero_optimization.stage3_param_persistence_threshold": 10 * 64,
}


def _nvme(cfg: dict, path) -> dict:
    cfg = copy.deepcopy(cfg)
    for section in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][section]["nvme_path"] = str(path)
    return cfg


def _no_scheduler(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "scheduler"}


def test_zero2_recipe_maps_every_key():
    kw = translate(HF_ZERO2, TRAINER_AUTO, trainer="a trainer")
    assert kw == dict(
        stage=2,
        offload_optimizer="cpu",
        offload_param="none",
        lr=5e-5,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        reduce_bucket_size=200_000_000,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
    )


def test_zero3_recipe_builds_the_engine_config(tmp_path, caplog):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_no_scheduler(HF_ZERO3)))
    with caplog.at_level(logging.INFO, logger="zero_offload.deepspeed_config"):
        cfg = zo.build_config(str(path))
    assert (cfg.stage, cfg.offload.optimizer, cfg.offload.param) == (3, "cpu", "cpu")
    assert cfg.precision.dtype == torch.float16
    assert cfg.precision.initial_loss_scale == 2.0**16
    assert cfg.precision.loss_scale_window == 1000 and cfg.precision.min_loss_scale == 1.0
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.weight_decay) == (
        3e-5,
        (0.8, 0.999),
        3e-7,
    )
    assert cfg.precision.loss_scale_hysteresis == 2
    assert cfg.offload.sub_group_size == 10**14
    assert cfg.prefetch_bytes == 0 and cfg.param_persistence_threshold == 0
    assert cfg.optimizer.max_grad_norm == 1.0  # DeepSpeed's default since 0.19.3
    # one line per key this library does not need, saying why
    ignored = [r.getMessage() for r in caplog.records]
    assert any("stage3_max_live_parameters" in m and "not needed" in m for m in ignored)
    assert any("offload_param.pin_memory" in m for m in ignored)
    assert len(ignored) == 9 == len(set(ignored))  # one per key, nothing twice


def test_zero3_nvme_recipe_prefetch_counts_elements(tmp_path):
    kw = translate(_nvme(HF_ZERO3_NVME, tmp_path), TRAINER_AUTO, trainer="a trainer")
    assert (kw["offload_optimizer"], kw["offload_param"], kw["nvme_path"]) == (
        "nvme",
        "nvme",
        str(tmp_path),
    )
    assert kw["sub_group_size"] == 10**9
    # DeepSpeed's prefetch bucket counts parameters; prefetch_bytes counts fp32 bytes here
    assert kw["prefetch_bytes"] == int(0.9 * 64 * 64) * 4
    assert kw["param_persistence_threshold"] == 640
    cfg = zo.build_config(kw)
    assert cfg.offload.nvme_path == str(tmp_path)


@pytest.mark.parametrize(
    "cfg, key",
    [
        (HF_ZERO2, "optimizer.params.lr"),  # "auto" without a trainer or keyword to fill it in
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "OneCycle"),
        ({"zero_optimization": {"stage": 2, "cpu_ofload": True}}, "did you mean"),
        (
            {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "loss_scale": 128}},
            "fp16.loss_scale",
        ),
        ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type"),
        (
            {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            "zero_quantized_weights",
        ),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "master"),
        (
            {
                "compression_training": {
                    "weight_quantization": {"shared_parameters": {"enabled": True}}
                }
            },
            "compression_training",
        ),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "foo": 1}}},
            "optimizer.params.foo",
        ),
        (
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            "train_batch_size=16",
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both 'fp16' and 'bf16'"),
    ],
)
def test_bad_keys_name_the_key(cfg, key):
    with pytest.raises(zo.ConfigError) as err:
        zo.build_config(cfg)
    assert key in str(err.value)


def test_keywords_win_over_the_file_and_both_are_validated():
    cfg = zo.build_config(_no_scheduler(HF_ZERO3), stage=2, offload_param="none", lr=1e-3)
    assert (cfg.stage, cfg.optimizer.lr, cfg.offload.optimizer) == (2, 1e-3, "cpu")
    with pytest.raises(zo.ConfigError, match="offload_param='cpu' needs stage=3"):
        zo.build_config(_no_scheduler(HF_ZERO3), stage=2)


def test_a_deepspeed_config_trains_like_its_keywords():
    """Stage 2 with the optimizer on the CPU, clipping and accumulation from a DeepSpeed
    dict: the same parameters, bit for bit, as the same run from keywords."""
    ds = {
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "reduce_bucket_size": 500,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "gradient_clipping": 0.05,
        "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 4,
    }

    def run(**kwargs):
        torch.manual_seed(0)
        engine = zo.initialize(make("mlp"), **kwargs)
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            x, y = batch("mlp", 4, gen)
            engine.backward(loss_fn("mlp", engine(x), y))
            engine.step()
        assert engine.global_steps == 3
        return engine.full_state_dict()

    a = run(config=ds)
    b = run(
        stage=2,
        offload_optimizer="cpu",
        reduce_bucket_size=500,
        lr=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.05,
        gradient_accumulation_steps=2,
    )
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize(
    "ds_type, params, reference",
    [
        ("Adagrad", {}, lambda p: torch.optim.Adagrad(p, lr=1e-2, eps=1e-10)),
        (
            "Adam",
            {"adam_w_mode": False, "lr": 1e-2, "weight_decay": 0.1},
            lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-8, weight_decay=0.1),
        ),
    ],
    ids=["Adagrad", "Adam-L2"],
)
def test_deepspeed_optimizer_types_train_like_torch(ds_type, params, reference):
    """DeepSpeed's Adagrad (its CPU class's defaults: lr 1e-2, eps 1e-10) and Adam with
    adam_w_mode false (L2 decay) train like the matching torch optimizer."""
    ds = {
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": ds_type, "params": params},
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(0)
    model = make("mlp")
    ref = copy.deepcopy(model)
    opt = reference(ref.parameters())
    engine = zo.initialize(model, config=ds)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = batch("mlp", 4, gen)
        engine.backward(loss_fn("mlp", engine(x), y))
        engine.step()
        opt.zero_grad()
        loss_fn("mlp", ref(x), y).backward()
        opt.step()
    ours = engine.full_state_dict()
    engine.close()
    diff = max((ours[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    assert diff <= 1e-3 * 1e-2, f"max |diff| = {diff / 1e-2:.2e} lr"


def test_deepspeed_lion_is_the_lion_keywords():
    """``type: Lion`` is optimizer_type='lion' with DeepSpeedCPULion's defaults (betas
    (0.9, 0.999), no weight decay): the same parameters, bit for bit, as the keywords."""
    ds = {"optimizer": {"type": "Lion", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0}
    kw = translate(ds)
    assert kw["optimizer_type"] == "lion" and kw["betas"] == (0.9, 0.999)

    def run(**kwargs):
        torch.manual_seed(0)
        engine = zo.initialize(make("mlp"), **kwargs)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = batch("mlp", 4, gen)
            engine.backward(loss_fn("mlp", engine(x), y))
            engine.step()
        sd = engine.full_state_dict()
        engine.close()
        return sd

    a = run(config=ds)
    b = run(optimizer_type="lion", lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    assert all(torch.equal(a[k], b[k]) for k in b)
    with pytest.raises(zo.ConfigError, match="Adam, AdamW, Lion and Adagrad"):
        translate({"optimizer": {"type": "OneBitAdam", "params": {}}})


def test_convert_config_prints_the_keywords(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_no_scheduler(HF_ZERO3)))
    assert main(["convert-config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["offload_param"] == "cpu"
    assert main(["convert-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("engine = zero_offload.initialize(model,") and "stage=3" in out
    path.write_text(json.dumps(HF_ZERO2))
    assert main(["convert-config", str(path)]) == 1
    assert "'optimizer.params.lr' is \"auto\"" in capsys.readouterr().err


def test_convert_config_takes_what_initialize_takes_and_names_the_world_size(
    tmp_path, capsys, monkeypatch
):
    """Batch sizes left "auto" are the data loader's, in convert-config as in initialize; the
    accumulation derived from train_batch_size depends on the world size, which it names."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    engine = zo.initialize(torch.nn.Linear(4, 4), config=str(path))
    engine.close()
    assert main(["convert-config", str(path), "--json"]) == 0
    assert "gradient_accumulation_steps" not in json.loads(capsys.readouterr().out)
    path.write_text(json.dumps({**ds, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}))
    assert main(["convert-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gradient_accumulation_steps=8" in out and "world size 1" in out
    assert main(["convert-config", str(path), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "gradient_accumulation_steps=2" in out and "world size 4" in out
    assert main(["convert-config", str(path), "--json", "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["gradient_accumulation_steps"] == 4
    assert "world size 2" in captured.err
