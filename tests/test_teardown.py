"""A finished multi-rank run ends cleanly: after ``engine.close()`` no zero_offload thread is
left, after ``destroy_process_group`` no gloo thread is left (the process group is really
freed, not torn down later by the interpreter's exit, where it can abort the process), and
each rank exits 0 by returning from its script, without ``os._exit``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import zero_offload as zo

TESTS = Path(__file__).resolve().parent
PACKAGE_ROOT = Path(zo.__file__).resolve().parent.parent

WORKER = """
    import os, sys, threading, torch, torch.distributed as dist
    import zero_offload as zo
    from support.models import TinyGPT, batch, loss_fn

    def native_threads():
        return [open(f"/proc/self/task/{t}/comm").read().strip()
                for t in sorted(os.listdir("/proc/self/task"), key=int) if int(t) != os.getpid()]

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), stage=3, lr=1e-2, offload_param="nvme",
                           offload_optimizer="nvme", nvme_path=sys.argv[1])
    for i in range(2):
        x, y = batch("gpt", 4, torch.Generator().manual_seed(10 * i + rank))
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
    engine.close()
    print("python threads after close:", [t.name for t in threading.enumerate()
                                          if t is not threading.main_thread()])
    dist.barrier()
    dist.destroy_process_group()
    print("native threads after destroy:", native_threads(), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_a_finished_two_rank_stage3_nvme_run_frees_its_threads_and_exits_zero(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    env = dict(
        os.environ,
        PYTHONPATH=f"{PACKAGE_ROOT}{os.pathsep}{TESTS}",
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "python threads after close: []" in out, out
        # before the fix: ['gloo_tcp_loop', 'pt_gloo_runloop', 'pt_gloo_runloop'] (and rank
        # 0's store, 'pt_tcpstore_uv'), destroyed only in the interpreter's teardown
        assert "native threads after destroy: []" in out, out
