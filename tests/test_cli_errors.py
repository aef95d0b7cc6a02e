"""Bad input to the planning API and the CLIs: a one-line error naming the fix and a
non-zero exit, never a traceback or a silent default."""

from __future__ import annotations

import pytest

import zero_offload as zo
from zero_offload.cli import main


def _rc(argv: list[str]) -> int:
    """The exit code, argparse's usage errors (SystemExit) included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


PLAN = ["plan", "--params", "13e9", "--gpus", "4", "--gpu-memory", "24GB"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("offload_optimizer_fraction", 1.5),
        ("offload_param_fraction", -0.5),
        ("prefetch_depth", -1),
        ("gradient_accumulation_steps", 0),
        ("host_memory_limit", -1),
        ("activation_bytes", -(10**9)),
        ("largest_layer_params", -1),
        ("gpus_per_node", -1),
        ("gpus_per_node", 0),
    ],
)
def test_estimate_refuses_what_initialize_refuses(key, value):
    kw = dict(stage=3, offload_optimizer="nvme", offload_param="nvme", **{key: value})
    with pytest.raises(zo.ConfigError, match=key):
        zo.estimate_memory(7e9, num_gpus=4, **kw)


@pytest.mark.parametrize(
    "extra",
    [
        ["--gpus-per-node", "-1"],
        ["--gpus-per-node", "0"],
        ["--prefetch-depth", "-1"],
        ["--params", "1e400"],
        ["--gpu-memory", "1e400GB"],
    ],
)
def test_plan_refuses_bad_numbers(extra, capsys):
    assert _rc(PLAN + extra) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


def test_more_gpus_per_node_than_gpus_is_the_gpus(capsys):
    host = ["--host-memory", "128GB", "--json"]
    assert main(PLAN + host + ["--gpus-per-node", "8"]) in (0, 1)
    over = capsys.readouterr().out
    assert main(PLAN + host) in (0, 1)
    assert over == capsys.readouterr().out
