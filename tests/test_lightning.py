"""Lightning through zero_offload (``ZeroOffloadStrategy`` and its registered names): the
library's tiny GPT-style LM on 1 rank and 2 gloo ranks under torchrun, stages 2 and 3, the
optimizer state and parameters on the CPU or NVMe. Each case (see lightning_worker.py) shows:
- the trained weights match plain Lightning with torch AdamW (``strategy="auto"`` on one rank,
  DDP on two, each with the same data order as ours), with an lr scheduler
  stepped every update, ``accumulate_grad_batches=2``, ``gradient_clip_val`` and an AdamW
  whose second parameter group (biases, norm weights) has no weight decay, within the
  equivalence criterion (0.03 lr in fp32);
- a run stopped after one epoch, saved with ``trainer.save_checkpoint`` and resumed by a new
  Trainer with ``fit(ckpt_path=...)`` ends exactly where the uninterrupted one did;
- the engine's step stats reach Lightning's logger (CSV here) next to the module's own;
- at stage 3, a model built in ``configure_model`` is built on the meta device (the strategy's
  sharded-construction context) and trains the same from the weights file it starts from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

from support.torchrun_cases import case_ids, per_world

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("lightning_worker.py")

CASES = {
    1: [
        "zero_offload_stage3_offload",  # parameters and optimizer state on the CPU
        # built in configure_model (on the meta device), started from a weights file
        dict(stage=3, offload_optimizer="cpu", offload_param="cpu", configure_model=True),
    ],
    2: [
        "zero_offload_stage3_offload_nvme",  # both on NVMe (path from ZERO_OFFLOAD_NVME_PATH)
        dict(stage=2, offload_optimizer="cpu"),
        dict(buffers=True, stage=2),  # BatchNorm: every rank takes rank 0's buffers
    ],
}


def _nvme_env(tmp: Path) -> dict[str, str]:
    (tmp / "nvme").mkdir()
    return {"ZERO_OFFLOAD_NVME_PATH": str(tmp / "nvme")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return per_world(tmp_path_factory, WORKER, CASES, "lightning", _nvme_env)


IDS = [(w, i) for w, i in case_ids(CASES) if "buffers" not in str(CASES[w][i])]


def _id(case):
    world, i = case
    c = CASES[world][i]
    return f"world{world}-" + (
        c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items())
    )


@pytest.mark.parametrize("case", IDS, ids=[_id(c) for c in IDS])
def test_strategy_matches_plain_lightning_and_resumes(results, case):
    world, i = case
    r = results(world)[i]
    assert r["global_step"] == 16 // (2 * world * 2) * 2  # two epochs of accumulated steps
    assert r["moved_lr"] > 1.0, "training must move the weights well beyond the tolerance"
    assert r["max_diff_lr"] <= 0.03, f"max |diff| = {r['max_diff_lr']:.4f} lr"
    assert r["resume_diff_lr"] == 0.0, "resumed run must end where the uninterrupted one did"
    assert {"latest", "lightning.pt"} <= set(r["checkpoint_files"])
    if "configure_model" in str(CASES[world][i]):
        assert r["built_on_meta"] is True
    for key in (
        "train_loss",
        "grad_norm",
        "zero_offload/step_s",
        "zero_offload/adam_s",
        "zero_offload/backward_s",
    ):
        assert key in r["logged"], key


def test_every_rank_takes_rank_zeros_buffers_before_each_training_forward(results):
    """DDP's broadcast_buffers, which ``engine(x)`` documents: under the strategy too, each
    training forward starts from rank 0's running statistics although the ranks' batches
    differ (so do the statistics each forward leaves behind)."""
    (r,) = [r for r in results(2) if "spread" in r]
    assert r["forwards"] == 4 and r["moved"] > 0.1
    assert r["spread"] == 0.0


def test_registered_names_and_a_clear_error_without_nvme_path(monkeypatch):
    import lightning.pytorch as pl  # noqa: F401
    from lightning.pytorch.strategies import StrategyRegistry

    import zero_offload as zo
    import zero_offload.integrations.lightning

    for name in (
        "zero_offload",
        "zero_offload_stage2_offload",
        "zero_offload_stage3_offload",
        "zero_offload_stage3_offload_nvme",
    ):
        assert name in StrategyRegistry
    monkeypatch.delenv("ZERO_OFFLOAD_NVME_PATH", raising=False)
    with pytest.raises(zo.ConfigError, match="ZERO_OFFLOAD_NVME_PATH"):
        StrategyRegistry.get("zero_offload_stage3_offload_nvme")
