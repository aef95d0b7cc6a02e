"""The package's import graph has no cycles, and nothing outside ``zero_offload/engine`` and
``zero_offload/update`` reaches into the engine's internal stepper or updater (the engine
offers what they need), but through the stepper's deprecated old name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from models import MLP

import zero_offload
import zero_offload as zo

ROOT = Path(zero_offload.__file__).resolve().parent
REPO = ROOT.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports at run time (``TYPE_CHECKING`` blocks
    are for types only and do not count)."""
    tree = ast.parse(path.read_text())
    package = (
        _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    )
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for name in [target] + [f"{target}.{a.name}" for a in node.names]:
                if name in modules:
                    found.add(name)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    # a module's own parent packages are imported before it whatever it says: not an edge
    graph = {
        m: {t for t in _runtime_imports(p, modules) - {m} if not m.startswith(t + ".")}
        for m, p in paths.items()
    }
    assert _cycles(graph) == []


def test_nothing_outside_the_engine_reaches_into_the_stepper() -> None:
    pattern = re.compile(r"(?<!update)\.(stepper|sharded_optimizer|updater)\b")  # not a module path
    offenders = []
    for folder in ("zero_offload", "examples", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            if (
                ROOT / "update" in path.parents
                or ROOT / "engine" in path.parents
                or path == Path(__file__).resolve()
            ):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_stepper_old_name_still_answers_and_says_what_to_read_instead() -> None:
    """The one way in from outside, kept for scripts written before the rename: they read
    ``.updater.last_timings`` through ``engine.sharded_optimizer``."""
    engine = zo.initialize(MLP(), stage=2)
    x = torch.randn(4, 16)
    engine.backward(engine(x).square().mean())
    engine.step()
    with pytest.warns(DeprecationWarning, match="last_step_timings"):
        old = engine.sharded_optimizer
    assert old.updater.last_timings is engine.last_step_timings


def test_package_code_outside_the_engine_uses_its_public_face() -> None:
    """Checkpoints, the rehearsal, trainers and tools read the engine through its methods
    (``held_tensors``, ``training_state``, ``forward_window``...), never through its parts
    or private names: the parts can change without them noticing."""
    parts = (
        "gatherer|clock|stepper|reducer|param_store|grad_queue|streams|unit_states|activations"
        "|grads|_[a-z_]+"
    )
    pattern = re.compile(rf"engine\.({parts})\b")
    offenders = []
    for path in ROOT.rglob("*.py"):
        if ROOT / "engine" in path.parents or ROOT / "update" in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []
