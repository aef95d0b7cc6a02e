"""Shared fixtures, and the order in which test files go to the workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.swap_faults import mounted_tmpfs

LONGEST_FIRST = (
    "test_examples",
    "test_host_memory",
    "test_rehearsal",
    "test_equivalence",
    "test_hf_models",
    "test_interrupt_campaign",
    "test_preemption_trainers",
    "test_hf_trainer",
    "test_swap_cleanup",
    "test_preemption",
    "test_early_update",
    "test_readme",
    "test_beyond_memory",
    "test_checkpoint",
    "test_tiers",
    "test_param_offload",
    "test_lifecycle",
    "test_trl",
    "test_lightning",
    "test_planner",
)
"""The files that take longest (40-140 s each in `pytest --durations` on a 2-vCPU host), longest
first. With `--dist loadfile` a worker takes one file at a time, so a long file handed out last
runs on one worker while the others sit idle; handing these out first leaves short files for the
end (the suite's wall time on 2 workers: 18:07 with xdist's order, by count of tests). The order
changes when each file runs, never what it checks; the other files follow in collection order."""


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    stale = [name for name in LONGEST_FIRST if not (here / f"{name}.py").is_file()]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names no such file: {stale}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: each file's tests stay together and in their own order
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A real 1 MiB filesystem: writing more than that fails with ENOSPC."""
    with mounted_tmpfs(tmp_path / "tiny", "size=1M") as mnt:
        yield mnt
