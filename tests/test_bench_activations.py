"""``zero-offload bench activations``: one case measured in this process (the command runs each
case in a fresh one), and the summary's ratios against the first case of the same round."""

from __future__ import annotations

import argparse

from zero_offload.bench.training import activations as bench


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    small = "--layers 2 --width 64 --heads 4 --vocab 256 --seq 32 --batch 2 --steps 1"
    args = parser.parse_args([*small.split(), "--min-bytes", "0", "--tile-tokens", "16"])
    vars(args).update(kw)
    return args


def test_a_case_reports_its_step_peak_and_offloaded_bytes():
    got = bench.measure("checkpoints+tiled", _args())
    assert got["step_s"] > 0 and got["forward_s"] > 0 and got["peak_rss"] > 0
    hidden = 2 * 32 * 64 * 4  # fp32 hidden states of the micro-batch
    # the two blocks' inputs, and the tiles' inputs: the last hidden states and the targets
    assert got["offloaded_bytes"] == 2 * hidden + hidden + 2 * 32 * 8
    assert got["host_buffer_bytes"] >= got["offloaded_bytes"]


def test_the_summary_compares_within_each_round():
    def case(name, step):
        return dict(
            case=name,
            step_s=step,
            cpu_s=step,
            forward_s=0,
            backward_s=0,
            peak_rss=1,
            offloaded_bytes=0,
            host_buffer_bytes=0,
            params=1,
        )

    rounds = [
        {"none": case("none", 1.0), "checkpoints": case("checkpoints", 1.2)},
        {"none": case("none", 2.0), "checkpoints": case("checkpoints", 2.2)},
    ]
    rows = bench._summary(rounds, ["none", "checkpoints"])
    assert rows[0]["ratio"] == 1.0
    assert rows[1]["ratios"] == [1.2, 1.1] and abs(rows[1]["ratio"] - 1.15) < 1e-12
