"""Lightning features under ZeroOffloadStrategy beyond the equivalence runs of
test_lightning.py, all in one spawned process (see lightning_features_worker.py):
- at world size 1 a ``shuffle=False`` loader trains on its own order, as under
  ``strategy="auto"`` (a DDP-based strategy would have Lightning swap in a shuffling
  DistributedSampler), to the same weights as plain Lightning.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

from torchrun_cases import launch  # noqa: E402

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("lightning_features_worker.py")
JOBS = ["order"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning_features")
    return launch(WORKER, 1, tmp, JOBS)  # type: ignore[arg-type]


def test_world_one_keeps_the_loaders_own_order(results):
    r = results["order"]
    assert r["seen"] == r["plain_seen"], "the strategy must not reorder a shuffle=False loader"
    assert r["moved_lr"] > 1.0
    assert r["max_diff_lr"] <= 0.03, f"max |diff| = {r['max_diff_lr']:.4f} lr"
