"""Run a function on N spawned ranks joined by a gloo process group, collect their results.

The ranks are forked from a fork server that imported torch and zero_offload once (the
first call starts it): a rank then starts in a fraction of a second instead of the two or
three seconds an interpreter takes to import torch, which over the suite's few hundred
ranks is minutes of CI. Each rank takes the environment of the call that started it, as a
spawned process would, not the one the server was started with.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "torch.distributed",
    "zero_offload",
    "support.distributed",
    "support.models",
    # the Hugging Face models the multi-rank HF tests build: 7 s of imports a rank otherwise
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
]
"""What the fork server imports once for every rank it forks (a name that fails to import,
transformers where it is not installed, is skipped by multiprocessing)."""


def _entry(
    rank: int,
    world_size: int,
    init_file: str,
    out_dir: str,
    fn: Callable,
    args: tuple,
    timeout: float | None,
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=None if timeout is None else timedelta(seconds=timeout),
    )
    try:
        result = fn(rank, world_size, *args)
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".tmp", path)  # complete, or absent
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float | None = None) -> list[Any]:
    """fn(rank, world_size, *args) on each rank; returns the per-rank return values.
    ``timeout``: seconds a collective may wait before it fails (for a test that could hang).

    A rank that dies by a signal after every rank has written its complete result is
    reported on stderr and tolerated: a process group that outlives destroy_process_group
    is torn down in the interpreter's exit, where gloo can abort ("terminate called without
    an active exception"; examples/gloo_teardown.py), after the work under test is done."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            mp.start_processes(
                _entry,
                args=(world_size, init_file, tmp, fn, args, timeout, dict(os.environ)),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
        except mp.ProcessExitedException as exc:
            done = all(os.path.exists(os.path.join(tmp, f"rank{r}.pkl")) for r in range(world_size))
            if exc.signal_name is None or not done:
                raise
            print(f"warning: {exc} after all ranks finished; results kept", file=sys.stderr)
        out = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


def finish_torchrun_worker(results: Any, out: str, rank: int) -> None:
    """End a worker script launched by torchrun: rank 0 writes ``results`` as JSON to ``out``,
    and every rank leaves the process group (the script then returns and exits 0)."""
    import json

    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
