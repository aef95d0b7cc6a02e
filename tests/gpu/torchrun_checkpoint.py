"""Run under ``torchrun`` by ``test_torchrun.py``: what a user's script does, nothing more — no
``torch.cuda.set_device``, the device comes from the launcher's ``LOCAL_RANK`` (and, in one
mode, a single visible GPU per process). Trains two steps at stage 3 with offload to host
memory, saves a checkpoint, loads it into a fresh engine, checks the weights came back, and
(rank 0, while every rank still holds its CUDA context) lists the processes on each GPU.
Writes ``rank<N>.json`` under the output folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the models
from support.models import batch, loss_fn, make

import zero_offload as zo


def _gpu_processes() -> dict[str, list[int]]:
    """Physical GPU index -> pids with a context on it (empty when the driver hides pids)."""

    def query(what: str) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{what}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    index = {bus: i for i, bus in query("gpu=index,pci.bus_id")}
    found: dict[str, list[int]] = {}
    for pid, bus in query("compute-apps=pid,gpu_bus_id"):
        found.setdefault(index.get(bus, bus), []).append(int(pid))
    return found


def _build() -> zo.Engine:
    torch.manual_seed(0)
    return zo.initialize(
        make("gpt"),
        stage=3,
        offload_optimizer="cpu",
        offload_param="cpu",
        dtype=torch.bfloat16,
        lr=1e-3,
    )


def main(out: Path) -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _build()
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = batch("gpt", 4 * world, gen)
        sl = slice(4 * rank, 4 * (rank + 1))
        engine.backward(loss_fn("gpt", engine(x[sl]), y[sl].to(engine.device)))
        engine.step()
    saved = engine.full_state_dict()
    engine.save_checkpoint(out / "ckpt")
    engine.close()
    resumed = _build()
    resumed.load_checkpoint(out / "ckpt")
    loaded = resumed.full_state_dict()
    same = all(torch.equal(saved[k], loaded[k]) for k in saved)
    info = {
        "pid": os.getpid(),
        "device": str(resumed.device),
        "same_weights": same,
        "current_device": torch.cuda.current_device(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    dist.barrier()
    if rank == 0:
        try:
            info["gpu_processes"] = _gpu_processes()
        except (OSError, subprocess.SubprocessError) as err:
            info["gpu_processes_error"] = repr(err)
    dist.barrier()
    resumed.close()
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
