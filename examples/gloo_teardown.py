"""Why a finished gloo run can abort at exit — torch alone, no zero_offload code.

``torch.distributed.nn.functional`` defines its collectives with ``group=group.WORLD`` as a
default argument, evaluated when the module is imported. Imported after
``init_process_group`` — ``torch._dynamo`` imports it, and ``torch.optim``'s first step
imports ``torch._dynamo`` — that default holds the default process group, so
``destroy_process_group`` cannot free it: its worker threads (``pt_gloo_runloop``), the
transport's event loop (``gloo_tcp_loop``) and rank 0's store (``pt_tcpstore_uv``) run on
until the interpreter's teardown collects the module and destroys the group there, where
gloo can abort the finished process ("terminate called without an active exception").
Imported before ``init_process_group`` (``import zero_offload`` does), the default is None
and the group is freed by ``destroy_process_group``.

Each run starts two ranks that join a gloo group, all-reduce, take one ``AdamW`` step,
leave with ``barrier`` and ``destroy_process_group``, print the threads still running
(from ``/proc/self/task``) and exit normally. The launcher counts exit codes and threads.

    python examples/gloo_teardown.py --runs 5            # imported after init: group kept
    python examples/gloo_teardown.py --runs 5 --early    # imported before init: group freed
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys


def native_threads() -> list[str]:
    """Names of this process's threads other than the main one (Linux)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        if int(tid) != os.getpid():
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
    return names


def rank_main(early: bool) -> None:
    import torch
    import torch.distributed as dist

    if early:
        import torch.distributed.nn.functional
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    torch.optim.AdamW([p]).step()
    dist.barrier()
    dist.destroy_process_group()
    print(
        f"rank {os.environ['RANK']}: threads after destroy_process_group: {native_threads()}",
        flush=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(runs: int, early: bool) -> int:
    outcome: collections.Counter[str] = collections.Counter()
    alive: collections.Counter[str] = collections.Counter()
    for _ in range(runs):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE="2",
            OMP_NUM_THREADS="1",
        )
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank-main"] + (["--early"] if early else []),
                env=dict(env, RANK=str(r)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            outcome[f"exit {proc.returncode}"] += 1
            if "terminate called" in err:
                outcome["'terminate called' on stderr"] += 1
            for line in out.splitlines():
                if "threads after" in line:
                    alive[line.split(": ", 2)[2]] += 1
    print(
        f"{runs} runs x 2 ranks, torch.distributed.nn imported "
        f"{'before' if early else 'after'} init_process_group"
    )
    for k, v in sorted(outcome.items()):
        print(f"  {k}: {v}")
    for k, v in alive.most_common():
        print(f"  ranks with threads {k} after destroy_process_group: {v}")
    return 0 if outcome.get("exit 0", 0) == 2 * runs else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--early", action="store_true", help="import torch.distributed.nn before init_process_group"
    )
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.early)
        return 0
    return launch(args.runs, args.early)


if __name__ == "__main__":
    sys.exit(main())
