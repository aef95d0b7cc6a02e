"""Launch a worker script under torchrun (or alone, for one rank) over a list of cases and read
back the JSON that its rank 0 writes: the set-up the trainer-integration tests share
(test_hf_trainer.py, test_lightning.py). A worker is called as
``python WORKER OUT.json TMPDIR CASES_JSON`` and ends with ``finish_torchrun_worker``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]


def launch(
    worker: Path,
    world: int,
    tmp: Path,
    cases: list[Any],
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> list[dict]:
    """Run ``worker`` on ``world`` ranks (gloo, one thread each) over ``cases``."""
    out = tmp / "results.json"
    launcher = (
        []
        if world == 1
        else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    )
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        **(env or {}),
    }
    res = subprocess.run(
        [sys.executable, *launcher, str(worker), str(out), str(tmp), json.dumps(cases)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return json.loads(out.read_text())


def per_world(
    tmp_path_factory: Any,
    worker: Path,
    cases: dict[int, list[Any]],
    name: str,
    env: Callable[[Path], dict[str, str]] | None = None,
) -> Callable[[int], list[dict]]:
    """``get(world)``: the results of ``cases[world]``, launched once per world size (use it
    in a module-scoped fixture). ``env(tmp)``: extra environment for a launch in ``tmp``."""
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            tmp = tmp_path_factory.mktemp(f"{name}{world}")
            cache[world] = launch(
                worker, world, tmp, cases[world], env(tmp) if env is not None else None
            )
        return cache[world]

    return get


def case_ids(cases: dict[int, list[Any]]) -> list[tuple[int, int]]:
    """(world, index) for every case, the parametrization of the tests."""
    return [(w, i) for w in cases for i in range(len(cases[w]))]
