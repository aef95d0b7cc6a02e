"""Tier and stage are types, parsed once at the boundary: outside the modules that read the
user's keywords, no code compares a tier string or a stage number; it asks a ``Tier`` or a
``Stage`` (``zero_offload/policies.py``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import zero_offload
from zero_offload.config import build_config
from zero_offload.policies import OFFLOAD_KEYWORDS, Stage, Tier

ROOT = Path(zero_offload.__file__).resolve().parent

# Where the user's strings and numbers are read, and so compared: each with its reason.
BOUNDARY = {
    "config/": "the config parser: validates stage and offload_* and parses them",
    "deepspeed_config/": "DeepSpeed's config, translated into the keywords",
    "cli/": "command-line verbs: their flags are the keywords' strings",
    "bench/": "benchmark commands: their flags are the keywords' strings, passed on as such",
}

TIER_STRINGS = {"none", "cpu", "nvme", "device", "host"}
# names that hold a tier or an offload keyword's value
TIER_NAMES = re.compile(r"tier|offload|^where$|^want$|^opt$|^optimizer$|^param$")


def _identifiers(node: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.append(n.id.lower())
        elif isinstance(n, ast.Attribute):
            out.append(n.attr.lower())
    return out


def _constants(node: ast.AST) -> list[object]:
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def policy_comparisons(source: str) -> list[tuple[int, str, str]]:
    """(line, "tier" or "stage", the comparison) for each comparison of a tier string with
    something named like a tier or an offload keyword, and of ``stage`` with an int."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        kind = None
        for a in sides:
            names = _identifiers(a)
            for b in sides:
                if a is b:
                    continue
                values = _constants(b)
                if any(isinstance(v, str) and v in TIER_STRINGS for v in values) and any(
                    TIER_NAMES.search(n) for n in names
                ):
                    kind = "tier"
                if any("stage" in n for n in names) and any(type(v) is int for v in values):
                    kind = "stage"
        if kind:
            found.append((node.lineno, kind, ast.unparse(node)))
    return found


def test_the_counter_finds_both_kinds() -> None:
    source = (
        "if cfg.offload.optimizer == 'nvme': pass\n"
        "if 'cpu' in (opt, param): pass\n"
        "if self.stage >= 2: pass\n"
        "if stage in (1, 2): pass\n"
        "if t.device.type == 'cpu': pass\n"  # a torch device, not a tier
        "if mode != 'none': pass\n"
    )
    assert [kind for _, kind, _ in policy_comparisons(source)] == [
        "tier",
        "tier",
        "stage",
        "stage",
    ]


def test_no_tier_or_stage_compared_outside_the_boundary() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "policies.py" or any(rel.startswith(b) for b in BOUNDARY):
            continue
        found += [f"{rel}:{line}: {text}" for line, _, text in policy_comparisons(path.read_text())]
    assert found == [], "compared outside the boundary; ask a Tier or a Stage:\n" + "\n".join(found)


def test_keywords_and_tiers_map_both_ways() -> None:
    assert OFFLOAD_KEYWORDS == ("none", "cpu", "nvme")
    assert [Tier.from_keyword(k) for k in OFFLOAD_KEYWORDS] == [Tier.DEVICE, Tier.HOST, Tier.NVME]
    assert [t.keyword for t in Tier] == list(OFFLOAD_KEYWORDS)
    # a Tier is its ledger name, so reports keyed by it read as before
    assert Tier.HOST == "host" and f"{Tier.NVME:<5}|" == "nvme |" and str(Tier.DEVICE) == "device"


@pytest.mark.parametrize(
    "stage, sharded, grads, params, during_backward",
    [
        (0, False, False, False, False),
        (1, True, False, False, False),
        (2, True, True, False, True),
        (3, True, True, True, True),
    ],
)
def test_what_each_stage_shards(stage, sharded, grads, params, during_backward) -> None:
    s = Stage(stage)
    assert s.number == stage
    assert (s.sharded, s.shards_optimizer, s.all_reduces) == (sharded, sharded, not sharded)
    assert (s.shards_grads, s.shards_params, s.reduces_during_backward) == (
        grads,
        params,
        during_backward,
    )


def test_the_config_parses_its_keywords_once() -> None:
    cfg = build_config(stage=3, offload_optimizer="nvme", offload_param="cpu", nvme_path="/tmp")
    assert cfg.sharding is Stage.PARAMS
    assert cfg.offload.optimizer_tier is Tier.NVME and cfg.offload.param_tier is Tier.HOST
    # what the user wrote stays what they read back
    assert (cfg.stage, cfg.offload.optimizer, cfg.offload.param) == (3, "nvme", "cpu")
