"""Hugging Face Trainer through zero_offload (``ZeroOffloadTrainer``): tiny GPT-2 and Llama
configs (nothing downloaded), 1 rank and 2 gloo ranks under torchrun, stages 2 and 3, the
optimizer state and parameters on the CPU or NVMe, configured by keywords or by DeepSpeed
recipe configs with "auto" values. Each case trains with the same data order three ways (see
hf_trainer_worker.py) and shows:
- the trained weights match plain Trainer with torch AdamW (DDP across ranks), with Trainer's
  linear lr schedule with warmup, gradient accumulation, max_grad_norm clipping and weight
  decay with Trainer's no-decay group (biases, norm weights), within the
  equivalence criterion (0.03 lr in fp32); for a DeepSpeed config, as Hugging Face's
  DeepSpeed integration runs it (its optimizer decays every parameter, its WarmupLR
  schedule drives the learning rate);
- the lr Trainer logs is the one its scheduler set, and the losses match, in training and in
  ``evaluate`` (which runs the model through the engine too);
- a run resumed from the checkpoint saved halfway ends exactly where the uninterrupted one did;
- save_model writes consolidated safetensors that from_pretrained loads to the engine's weights;
- every logged step carries the engine's step stats and the gradient norm.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from support.torchrun_cases import case_ids, per_world
from test_ds_config import HF_ZERO2, HF_ZERO3_NVME

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("hf_trainer_worker.py")


def _nvme_recipe() -> dict:
    cfg = copy.deepcopy(HF_ZERO3_NVME)
    for section in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][section]["nvme_path"] = "NVME"  # the worker's folder
    return cfg


CASES = {
    1: [("llama", _nvme_recipe())],  # stage 3, optimizer and parameters on NVMe
    2: [
        ("llama", dict(stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="NVME")),
        ("gpt2", HF_ZERO2),
    ],  # stage 2, optimizer on the CPU, every value "auto"
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return per_world(tmp_path_factory, WORKER, CASES, "hf")


IDS = case_ids(CASES)


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
    for key in (
        "grad_norm",
        "zero_offload/forward_s",
        "zero_offload/backward_s",
        "zero_offload/step_s",
        "zero_offload/adam_s",
        "zero_offload/loss_scale",
    ):
        assert key in r["logged_keys"], key
