import json
import typing

import pytest
import torch
from support.models import MLP, batch, loss_fn

import zero_offload as zo
from zero_offload.config import (
    ActivationConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
    build_config,
    describe,
    flat_keys,
)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(stage=5), ["stage=5", "0, 1, 2 or 3"]),
        (dict(stage=True), ["stage=True"]),
        (dict(prefetch_depth=-1), ["prefetch_depth=-1", ">= 0"]),
        (dict(stage=2, offload_param="cpu"), ["offload_param='cpu'", "stage=3"]),
        (dict(stage=1, offload_optimizer="nvme"), ["nvme_path"]),
        (dict(stage=3, offload_param="nvme"), ["nvme_path"]),
        (dict(prefetch_dept=2), ["prefetch_dept", "did you mean 'prefetch_depth'"]),
        (dict(lr=-1.0), ["lr=-1.0", ">= 0"]),
        (dict(lr="fast"), ["lr='fast'"]),
        (dict(betas=(0.9,)), ["betas"]),
        (dict(betas=(0.9, 1.5)), ["betas", "[0, 1)"]),
        (dict(eps=0), ["eps=0"]),
        (dict(dtype="int8"), ["dtype='int8'"]),
        (dict(dtype=torch.int32), ["dtype=torch.int32"]),
        (dict(offload_optimizer="disk"), ["offload_optimizer='disk'", "'none', 'cpu' or 'nvme'"]),
        (dict(gradient_accumulation_steps=0), ["gradient_accumulation_steps=0"]),
        (dict(max_grad_norm=0.0), ["max_grad_norm=0.0"]),
        (dict(reduce_bucket_size=2.5), ["reduce_bucket_size=2.5", "integer"]),
        (dict(host_memory_limit=0), ["host_memory_limit=0"]),
        (dict(device="gpu:zero"), ["device='gpu:zero'"]),
        (dict(stage=0, offload_optimizer="cpu"), ["stage 1, 2 or 3"]),
        (dict(broadcast_buffers="yes"), ["broadcast_buffers='yes'", "True or False"]),
    ],
)
def test_bad_input_names_key_value_and_fix(kwargs, words):
    with pytest.raises(zo.ConfigError) as err:
        build_config(**kwargs)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(stage=4),
        dict(stage=3, lr=float("nan")),
        dict(stage=3, eps=float("nan")),
        dict(stage=3, weight_decay=float("inf")),
        dict(stage=3, max_grad_norm=float("nan")),
    ],
    ids=["stage", "lr-nan", "eps-nan", "wd-inf", "clip-nan"],
)
def test_initialize_validates_before_touching_the_model(kwargs):
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(zo.ConfigError) as err:
        zo.initialize(model, optimizer_type="lion", moment_precision="8bit", **kwargs)
    key = next(k for k in kwargs if k != "stage" or len(kwargs) == 1)
    assert f"{key}=" in str(err.value)
    assert torch.equal(model.weight, before) and model.weight.dtype == torch.float32


def test_dict_and_json_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"stage": 2, "lr": 3e-4, "dtype": "bfloat16"}))
    cfg = build_config(str(path), lr=1e-4)
    assert cfg.stage == 2 and cfg.optimizer.lr == 1e-4 and cfg.dtype == torch.bfloat16
    assert build_config({"stage": 3, "prefetch_depth": 0}).prefetch_depth == 0
    with pytest.raises(zo.ConfigError, match="no such file"):
        build_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{stage: 2")
    with pytest.raises(zo.ConfigError, match="not valid JSON"):
        build_config(str(tmp_path / "bad.json"))


def test_every_key_has_a_default_and_round_trips():
    cfg = build_config()
    flat = describe(cfg)
    assert set(flat) == set(zo.config_keys()) - {"process_group"}
    assert flat["stage"] == 0 and flat["offload_optimizer"] == "none"


def _keys_typed(takes) -> list[str]:
    """Every flat key whose dataclass field's type ``takes`` accepts, read from the
    dataclasses themselves so a new knob is covered without editing this test."""
    sections = {
        "optimizer": OptimizerConfig,
        "precision": PrecisionConfig,
        "offload": OffloadConfig,
        "activations": ActivationConfig,
    }
    out = []
    for key, (section, name) in flat_keys().items():
        if takes(typing.get_type_hints(sections[section] if section else ZeroConfig)[name]):
            out.append(key)
    return sorted(out)


def _integer_keys() -> list[str]:
    """Fields typed ``int`` or ``int | None``."""
    return _keys_typed(lambda hint: hint in (int, int | None))


def test_integer_keys_are_found():
    keys = _integer_keys()
    assert {
        "stage",
        "prefetch_depth",
        "sub_group_size",
        "host_memory_limit",
        "loss_scale_window",
    } <= set(keys)
    assert "lr" not in keys and "nvme_path" not in keys


def _float_keys() -> list[str]:
    """Fields that take a float."""
    return _keys_typed(lambda hint: hint is float or float in typing.get_args(hint))


# inf has a meaning here: the norm is measured (engine.last_grad_norm) and never clips
INF_ALLOWED = {"max_grad_norm"}


def test_float_keys_are_found():
    assert set(_float_keys()) == {
        "lr",
        "eps",
        "weight_decay",
        "max_grad_norm",
        "initial_loss_scale",
        "min_loss_scale",
        "offload_optimizer_fraction",
        "offload_param_fraction",
    }


@pytest.mark.parametrize("key", _float_keys())
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_float_keys_refuse_nan_and_a_meaningless_inf(key, value):
    if value == float("inf") and key in INF_ALLOWED:
        assert getattr(build_config(**{key: value}).optimizer, key) == value
        return
    with pytest.raises(zo.ConfigError) as err:
        build_config(**{key: value})
    assert f"{key}={value!r} is not valid" in str(err.value)


@pytest.mark.parametrize("betas", [(float("nan"), 0.999), (0.9, float("inf"))])
def test_betas_refuse_non_finite(betas):
    with pytest.raises(zo.ConfigError, match="betas"):
        build_config(betas=betas)


def test_max_grad_norm_inf_measures_the_norm_and_never_clips():
    results, norms = [], []
    for clip in (None, float("inf")):
        torch.manual_seed(0)
        engine = zo.initialize(MLP(), lr=1e-2, max_grad_norm=clip)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = batch("mlp", 4, gen)
            engine.backward(loss_fn("mlp", engine(x), y) * 1e3)
            engine.step()
        results.append(engine.full_state_dict())
        norms.append(engine.last_grad_norm)
        engine.close()
    assert norms[0] is None and norms[1] is not None and 0 < norms[1] < float("inf")
    for k, v in results[0].items():
        assert torch.equal(results[1][k], v), k


def _outcome(source) -> tuple[str, object]:
    try:
        return "ok", build_config(**source) if isinstance(source, dict) else build_config(source)
    except zo.ConfigError as exc:
        return "error", exc


@pytest.mark.parametrize("key", _integer_keys())
def test_whole_number_keys_take_integral_floats(key, tmp_path):
    """An integral float (as JSON writes 8e9 or 1e6) means the integer, from a dict, keywords or
    a JSON file; the built config holds a real int, so nothing downstream sees a float."""
    extra = {"nvme_path": str(tmp_path)}  # lets every value of every key validate
    accepted = 0
    for literal in ("0.0", "1.0", "2.0", "3.0", "1e6", "8e9"):
        whole = int(float(literal))
        expect, cfg = _outcome({**extra, key: whole})
        path = tmp_path / "cfg.json"
        path.write_text('{"nvme_path": %s, "%s": %s}' % (json.dumps(str(tmp_path)), key, literal))
        for source in ({**extra, key: float(literal)}, str(path)):
            got, built = _outcome(source)
            assert got == expect, (key, literal, built)
            if got == "ok":
                assert describe(built) == describe(cfg)
                assert type(describe(built)[key]) is int, (key, literal)
        accepted += expect == "ok"
    assert accepted >= 1, f"no whole value of {key} was valid: the test checks nothing"


@pytest.mark.parametrize("key", _integer_keys())
@pytest.mark.parametrize("value", [2.5, float("nan"), float("inf")], ids=["2.5", "nan", "inf"])
def test_whole_number_keys_refuse_fractions(key, value):
    with pytest.raises(zo.ConfigError) as err:
        build_config(**{key: value})
    assert f"{key}={value!r}" in str(err.value)


def test_float_keys_train_like_ints(tmp_path):
    """Stage 3 with everything on NVMe and every whole-number knob given as a float trains
    exactly like the same run with ints (floats used to fail in initialize or the forward)."""
    keys = dict(
        stage=3,
        prefetch_depth=2,
        reduce_bucket_size=1_000_000,
        sub_group_size=1000,
        gradient_accumulation_steps=1,
        prefetch_bytes=8_000_000_000,
        param_persistence_threshold=0,
        loss_scale_window=1000,
        loss_scale_hysteresis=2,
        host_memory_limit=1_000_000_000,
        offload_activations_min_bytes=0,
        offload_activations_prefetch=2,
        tiled_loss=0,
    )
    assert set(keys) == set(_integer_keys())
    results = []
    for convert in (int, float):
        torch.manual_seed(0)
        engine = zo.initialize(
            MLP(),
            lr=1e-2,
            offload_optimizer="nvme",
            offload_param="nvme",
            nvme_path=tmp_path / convert.__name__,
            **{k: convert(v) for k, v in keys.items()},
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = batch("mlp", 4, gen)
            engine.backward(loss_fn("mlp", engine(x), y))
            engine.step()
        results.append(engine.full_state_dict())
        engine.close()
    for k, v in results[0].items():
        assert torch.equal(results[1][k], v), k
