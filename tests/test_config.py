import json

import pytest
import torch

import zero_offload as zo
from zero_offload.config import build_config, describe


@pytest.mark.parametrize("kwargs, words", [
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
])
def test_bad_input_names_key_value_and_fix(kwargs, words):
    with pytest.raises(zo.ConfigError) as err:
        build_config(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_initialize_validates_before_touching_the_model():
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(zo.ConfigError):
        zo.initialize(model, stage=4)
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
