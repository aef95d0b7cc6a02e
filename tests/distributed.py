"""Run a function on N spawned ranks joined by a gloo process group, collect their results."""
from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable,
           args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on each rank; returns the per-rank return values."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(world_size, init_file, tmp, fn, args),
                           nprocs=world_size, join=True, start_method="spawn")
        out = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out
