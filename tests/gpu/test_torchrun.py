"""Two ranks under ``torchrun`` with nothing but the launcher's environment (``LOCAL_RANK``
and friends; the script never calls ``torch.cuda.set_device``), once with every GPU visible
and once with one visible GPU per process: checkpoint save and load work (a wrong device,
or every rank's collectives on GPU 0, would raise "invalid device ordinal", hang, or fail
NCCL with a duplicate GPU), and GPU 0 hosts rank 0's process only (no stray CUDA context of
another rank on it). Skipped without two GPUs; ``tests/gpu/check.sh`` runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or torch.cuda.device_count() < 2
        or not dist.is_nccl_available(),
        reason="needs 2 GPUs and NCCL",
    ),
]

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "torchrun_checkpoint.py"


@pytest.mark.parametrize("visible", ["all", "one_per_rank"])
def test_checkpoint_under_torchrun_with_only_local_rank(
    tmp_path: Path, record_property, visible: str
) -> None:
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    if visible == "all":
        command = launcher + [str(SCRIPT), str(tmp_path)]
    else:
        command = launcher + [
            "--no-python",
            "bash",
            str(HERE / "one_gpu_per_rank.sh"),
            str(SCRIPT),
            str(tmp_path),
        ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["ZO_PYTHON"] = sys.executable
    env["CUDA_VISIBLE_DEVICES"] = "0,1"
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["same_weights"] for r in ranks), "the checkpoint did not restore the weights"
    if visible == "all":
        assert [r["current_device"] for r in ranks] == [0, 1], (
            "each rank must make its own GPU current (torch.cuda.set_device)"
        )
    processes = ranks[0].get("gpu_processes") or {}
    record_property("gpu_processes", processes)
    if not any(ranks[0]["pid"] in pids for pids in processes.values()):
        record_property("gpu0_only_rank0", "not verifiable: nvidia-smi shows other pids")
        return
    assert processes.get("0", []) == [ranks[0]["pid"]], (
        f"GPU 0 hosts {processes.get('0')}, expected only rank 0's pid {ranks[0]['pid']}"
    )
