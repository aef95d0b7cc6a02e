"""One errors module: every error zero_offload raises on purpose is defined there, derives
from ``ZeroOffloadError`` and keeps its builtin kind, and is exported from the package."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import zero_offload
from zero_offload import errors

ROOT = Path(zero_offload.__file__).resolve().parent


def test_no_exception_class_is_defined_outside_the_errors_module() -> None:
    found = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b).split(".")[-1].endswith(("Error", "Exception"))
                or ast.unparse(b) in errors.__all__
                for b in node.bases
            ):
                found.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert found == []


def test_every_error_is_exported_and_shares_the_base() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ZeroOffloadError), name
        assert getattr(zero_offload, name) is cls, f"zero_offload.{name} is not exported"
        assert name in zero_offload.__all__


def test_errors_keep_their_builtin_kind_and_survive_pickling() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.BufferBudgetError, ValueError)
    assert issubclass(errors.SwapIOError, OSError)
    assert issubclass(errors.CheckpointError, RuntimeError)
    assert issubclass(errors.IncompleteStepError, RuntimeError)
    e = errors.SwapIOError("/x/y", "short read: 1 of 2 bytes", offset=4096, nbytes=2, errno=5)
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, errors.ZeroOffloadError) and str(back) == str(e)
    assert back.errno == 5
