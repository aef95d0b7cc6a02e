"""Bad input to the planning API and the CLIs: a one-line error naming the fix and a
non-zero exit, never a traceback or a silent default."""

from __future__ import annotations

import pytest

import zero_offload as zo
from zero_offload.cli import build_parser, main


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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint with tags step2 (latest) and second."""
    import torch

    root = tmp_path_factory.mktemp("ck") / "ck"
    engine = zo.initialize(torch.nn.Linear(4, 4), stage=2, dtype="float32", lr=1e-3)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    engine.save_checkpoint(root, tag="step1")
    engine.save_checkpoint(root, tag="second")
    engine.close()
    return root


@pytest.mark.parametrize(
    ("command", "out", "needle"),
    [
        ("consolidate", "missing_dir/out.pt", "mkdir"),
        ("consolidate", "a_dir", "is a folder"),
        ("export-dcp", "a_file", "is a file"),
    ],
)
def test_bad_output_paths_are_one_line_errors(ckpt, tmp_path, capsys, command, out, needle):
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    assert _rc([command, str(ckpt), str(tmp_path / out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["consolidate", "export-dcp"])
def test_wrong_tag_lists_the_tags(ckpt, tmp_path, capsys, command):
    assert _rc([command, str(ckpt), str(tmp_path / "x"), "--tag", "nope"]) == 1
    err = capsys.readouterr().err
    assert "no tag 'nope'" in err and "second" in err and "step1" in err, err
    assert "incomplete" not in err


def test_incomplete_tag_is_still_incomplete(ckpt, tmp_path, capsys):
    (ckpt / "broken").mkdir(exist_ok=True)
    assert _rc(["consolidate", str(ckpt), str(tmp_path / "x.pt"), "--tag", "broken"]) == 1
    assert "incomplete" in capsys.readouterr().err


def test_bench_step_refuses_what_it_cannot_run(capsys):
    from zero_offload.bench.training import step

    for params in ("0", "-5"):
        with pytest.raises((ValueError, SystemExit)):
            step.model_config(build_parser().parse_args(["bench", "step", "--params", params]))
    tiny = ["bench", "step", "--preset", "tiny", "--steps", "1", "--dtype", "float32"]
    assert _rc([*tiny, "--stage", "2", "--offload-optimizer", "cpu", "--offload-param", "cpu"]) == 2
    assert "needs stage=3" in capsys.readouterr().err


def test_bench_counts_and_block_size(tmp_path, capsys):
    for cmd in (["bench", "adam"], ["bench", "step"]):
        assert build_parser().parse_args([*cmd, "--params", "1e6"]).params == 10**6
    io = ["bench", "io", "--path", str(tmp_path), "--size", "1MB", "--rounds", "1"]
    assert _rc([*io, "--block-size", "0", "--baseline", "python"]) == 2
    assert "block-size" in capsys.readouterr().err


def test_rate_flags_keep_the_plan_when_nothing_fits(capsys):
    tight = [*PLAN, "--host-memory", "1GB", "--nvme-bytes", "2TB"]
    assert _rc(tight) == 1
    table = capsys.readouterr().out
    assert _rc([*tight, "--gpu", "rtx4090"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(table.rstrip()) and "no step time is predicted" in out


def test_a_parameter_count_predicts_a_step_with_its_activations_given(capsys):
    """With --params there is no model to size activations from: --activation-memory gives
    them and --micro-batch counts a step's tokens (the messages used to send each to the
    other, then refuse both)."""
    rates = ["--gpu", "rtx4090", "--nvme-drive", "samsung-990pro", "--micro-batch", "1x2048"]
    args = ["plan", "--params", "13e9", "--gpus", "4", "--gpu-memory", "24GB", *rates]
    assert main([*args, "--host-memory", "128GB", "--activation-memory", "2GB"]) == 0
    assert "predicted step:" in capsys.readouterr().out
    assert main([*args, "--host-memory", "128GB"]) == 2
    assert "give activation_bytes as well" in capsys.readouterr().err
