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
