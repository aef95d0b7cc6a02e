"""The package's import graph has no cycles (imports for types only and inside functions count
too), every import goes down or across the package's layers (``LAYERS``), and nothing outside
``zero_offload/engine`` and ``zero_offload/update`` reaches into the engine's internal stepper
or updater (the engine offers what they need), but through the stepper's deprecated old
name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from support.models import MLP

import zero_offload
import zero_offload as zo

ROOT = Path(zero_offload.__file__).resolve().parent
REPO = ROOT.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports anywhere: at the top, inside functions,
    and under ``TYPE_CHECKING`` (a type-only import is still a dependency a reader follows)."""
    tree = ast.parse(path.read_text())
    package = (
        _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    )
    found = set()
    for node in ast.walk(tree):
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


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    # a module's own parent packages are imported before it whatever it says: not an edge
    return {
        m: {t for t in _imports(p, modules) - {m} if not m.startswith(t + ".")}
        for m, p in paths.items()
    }


def test_no_import_cycles() -> None:
    assert _cycles(_import_graph()) == []


# Bottom to top. A module belongs to the longest entry naming it or a package above it, and
# imports only modules of its own layer or below; a new sub-package must be placed here.
LAYERS: list[set[str]] = [
    # keywords and leaf vocabularies; activations.config is the keyword section config holds
    {"errors", "policies", "fields", "quantities", "deepspeed_config", "activations.config"},
    {"comm", "progress", "weak", "interrupts", "partition"},  # utilities with no policy
    {"swap", "optim", "bench"},  # bench's own modules: the GPT shapes the estimate reads
    {"device"},
    {"config"},
    {"memory"},
    {"params"},
    {"grads", "activations"},
    {"update", "checkpoint"},  # checkpoint reads and restores a run through Checkpointable
    {"engine", "planning"},
    {"integrations", "rehearsal", "bench.micro", "bench.training", "bench.interrupts"},
    {"cli", ""},  # "": the package's __init__, which exports from every layer
]


_LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _layer(module: str) -> int:
    name = module.removeprefix("zero_offload").removeprefix(".")
    for unit in sorted(_LAYER_OF, key=len, reverse=True):
        if name == unit or name.startswith(unit + "."):
            return _LAYER_OF[unit]
    raise AssertionError(f"{module} is in no layer of LAYERS")


def test_imports_go_down_the_layers() -> None:
    graph = _import_graph()
    upward = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m in sorted(graph)
        for d in sorted(graph[m])
        if _layer(d) > _layer(m)
    ]
    assert upward == []


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


def test_no_module_over_400_lines_and_no_folder_over_12_modules() -> None:
    """A module a reader can hold in mind, a folder a unit of understanding."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in ROOT.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines: {long}"
    crowded = {
        str(folder.relative_to(ROOT.parent)): n
        for folder in [ROOT, *(p for p in ROOT.rglob("*") if p.is_dir())]
        if (n := sum(1 for m in folder.glob("*.py") if m.name != "__init__.py")) > 12
    }
    assert not crowded, f"folders over 12 modules: {crowded}"
