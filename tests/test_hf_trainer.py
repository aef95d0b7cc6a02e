"""Hugging Face Trainer through zero_offload (``ZeroOffloadTrainer``): tiny GPT-2 and Llama
configs (nothing downloaded), 1 rank and 2 gloo ranks under torchrun, stages 2 and 3, the
optimizer state and parameters on the CPU or NVMe, configured by keywords or by DeepSpeed
recipe configs with "auto" values. Each case trains with the same data order three ways (see
hf_trainer_worker.py) and shows:
- the trained weights match plain Trainer with torch AdamW (DDP across ranks), with Trainer's
  linear lr schedule with warmup, gradient accumulation and max_grad_norm clipping, within the
  equivalence criterion (0.03 lr in fp32);
- the lr Trainer logs is the one its scheduler set, and the losses match, in training and in
  ``evaluate`` (which runs the model through the engine too);
- a run resumed from the checkpoint saved halfway ends exactly where the uninterrupted one did;
- save_model writes consolidated safetensors that from_pretrained loads to the engine's weights;
- every logged step carries the engine's step stats and the gradient norm.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from test_ds_config import HF_ZERO2, HF_ZERO3_NVME  # noqa: E402

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("hf_trainer_worker.py")


def _nvme_recipe() -> dict:
    cfg = copy.deepcopy(HF_ZERO3_NVME)
    for section in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][section]["nvme_path"] = "NVME"  # the worker's folder
    return cfg


CASES = {
    1: [("llama", _nvme_recipe())],  # stage 3, optimizer and parameters on NVMe
    2: [("llama", dict(stage=3, offload_optimizer="nvme", offload_param="nvme",
                       nvme_path="NVME")),
        ("gpt2", HF_ZERO2)],  # stage 2, optimizer on the CPU, every value "auto"
}


def _launch(world: int, tmp: Path) -> list[dict]:
    out = tmp / "results.json"
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, *launcher, str(WORKER), str(out), str(tmp),
                          json.dumps(CASES[world])], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = _launch(world, tmp_path_factory.mktemp(f"hf{world}"))
        return cache[world]
    return get


IDS = [(w, i) for w in CASES for i in range(len(CASES[w]))]


def _id(case):
    world, i = case
    name, cfg = CASES[world][i]
    kind = "deepspeed" if "zero_optimization" in cfg else "keywords"
    return f"world{world}-{name}-{kind}{i}"


@pytest.mark.parametrize("case", IDS, ids=[_id(c) for c in IDS])
def test_trainer_matches_plain_trainer_and_resumes(results, case):
    world, i = case
    r = results(world)[i]
    assert r["moved_lr"] > 1.0, "training must move the weights well beyond the tolerance"
    assert r["max_diff_lr"] <= 0.03, f"max |diff| = {r['max_diff_lr']:.4f} lr"
    assert r["lrs"] == r["plain_lrs"] and len(r["lrs"]) == 4
    assert r["losses"] == pytest.approx(r["plain_losses"], rel=1e-4)
    assert r["eval_loss"] == pytest.approx(r["plain_eval_loss"], rel=1e-4)
    assert r["resume_diff_lr"] == 0.0, "resumed run must end where the uninterrupted one did"
    assert r["saved_diff_lr"] == 0.0
    assert "model.safetensors" in r["saved_files"]
    assert {"zero_offload", "scheduler.pt", "trainer_state.json"} <= set(r["checkpoint_files"])
    for key in ("grad_norm", "zero_offload/forward_s", "zero_offload/backward_s",
                "zero_offload/step_s", "zero_offload/adam_s", "zero_offload/loss_scale"):
        assert key in r["logged_keys"], key
