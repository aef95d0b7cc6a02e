"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.swap_faults import mounted_tmpfs


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A real 1 MiB filesystem: writing more than that fails with ENOSPC."""
    with mounted_tmpfs(tmp_path / "tiny", "size=1M") as mnt:
        yield mnt


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most multi-rank or large tests first (``--no-loadscope-reorder`` keeps
    this order), so the workers end on short files: xdist's default puts the files with the
    most tests first, which left the few-test multi-rank files last, one worker running them
    while the other idled (CI on 2 vCPUs: 63% busy)."""
    heavy: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        path = item.nodeid.split("::")[0]
        first.setdefault(path, i)
        marked = item.get_closest_marker("multiprocess") or item.get_closest_marker("large")
        heavy[path] = heavy.get(path, 0) + bool(marked)
    items.sort(key=lambda it: (-heavy[it.nodeid.split("::")[0]], first[it.nodeid.split("::")[0]]))
