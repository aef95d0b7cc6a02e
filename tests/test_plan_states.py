"""The estimate and the planner with optimizer-state precisions: bytes per element from the
policy (checked against the policy's own sizes and a hand count of an 8-bit layout), the
engine's NVMe split rule kept for fp32, the plan's row per precision, and the 13B reference
run fitting in host memory once lower precision is allowed."""

from __future__ import annotations

import json
import math

import pytest
import torch.nn as nn

import zero_offload as zo
from zero_offload.cli import main as cli_main
from zero_offload.optim.policy import ABSMAX_BYTES, BLOCK, MIN_QUANTIZED_NUMEL, StatePolicy
from zero_offload.planning.estimate.state import FP32_STATE, state_split
from zero_offload.planning.search.precisions import row_policies
from zero_offload.update.nvme.sizing import optimizer_split

GB = 10**9
# 8-bit moments: a code per element and an fp32 absmax per 256-element block
Q = 1 + ABSMAX_BYTES / BLOCK
ROWS = {  # (moments, master) -> bytes/param of AdamW, counted by hand
    ("fp32", "fp32"): 4 + 4 + 4,
    ("bf16", "fp32"): 4 + 2 + 2,
    ("8bit", "fp32"): 4 + 2 * Q,
    ("8bit", "bf16_kahan"): 2 + 2 + 2 * Q,
    ("8bit", "bf16_sr"): 2 + 2 * Q,
}
REFERENCE = dict(num_gpus=4, gpu_memory=24 * GB, host_memory=128 * GB)  # 13B on 4 × 24 GB


def _term(e: zo.MemoryEstimate, name: str) -> int:
    return sum(t.bytes for t in e.terms if t.name == name)


def test_rows_and_their_bytes_per_param():
    rows = row_policies("adamw")
    assert [(p.moments.value, p.master.value) for _, p in rows] == list(ROWS)
    for _, p in rows:
        assert p.bytes_per_param == pytest.approx(ROWS[p.moments.value, p.master.value])
        # the policy's own sizes of one large parameter agree with its per-param figure
        n = 1 << 20
        exact = p.master_bytes(n) + p.num_moments * p.moment_bytes(n, blocks=n // BLOCK)
        assert exact == pytest.approx(p.bytes_per_param * n)
    assert ROWS["8bit", "bf16_sr"] <= 5  # the smallest: the bound of 5 bytes/param
    lion = {
        p.moments.value + "/" + p.master.value: p.bytes_per_param for _, p in row_policies("lion")
    }
    assert lion == pytest.approx(
        {
            "fp32/fp32": 8,
            "bf16/fp32": 6,
            "8bit/fp32": 4 + Q,
            "8bit/bf16_kahan": 4 + Q,
            "8bit/bf16_sr": 2 + Q,
        }
    )
    assert [p.moments.value for _, p in row_policies("adagrad")] == ["fp32"]


@pytest.mark.parametrize(("moments", "master"), list(ROWS))
def test_host_state_follows_the_policy(moments, master):
    psi, n = 10**9, 4
    e = zo.estimate_memory(
        psi, num_gpus=n, stage=2, offload_optimizer="cpu",
        moment_precision=moments, master_precision=master,
    )  # fmt: skip
    state = math.ceil(ROWS[moments, master] * psi / n)
    assert _term(e, "optimizer state") == state
    assert e.model_state_bytes("host") == state + 2 * psi // n  # + the bf16 grad shard
    assert e.to_dict()["moment_precision"] == moments
    # on the device (no offload) the same bytes
    e = zo.estimate_memory(
        psi, num_gpus=n, stage=2, moment_precision=moments, master_precision=master
    )
    assert _term(e, "optimizer state") == state


def test_fp32_params_as_master_keep_only_the_moments():
    """fp32 compute dtype, stage 0 on the device: the params are the master, so only the
    moments count (8-bit: 2 × (1 + 4/256) bytes), whatever the policy's master would be."""
    psi = 10**8
    e = zo.estimate_memory(psi, num_gpus=1, stage=0, dtype="float32", moment_precision="8bit")
    assert _term(e, "optimizer state") == math.ceil(2 * Q * psi)
    e = zo.estimate_memory(psi, num_gpus=1, stage=0, dtype="float32")
    assert _term(e, "optimizer state") == 8 * psi


def test_a_model_is_counted_by_the_optimizer_layout():
    """With a model, 8-bit state is counted as the optimizer lays it out: parameters under
    4096 elements and padding keep fp32 moments beside their unused code, each quantized one
    has a block per 256 elements from its first element. Counted here by hand for one rank."""
    model = nn.Sequential(nn.Linear(1000, 300), nn.LayerNorm(300), nn.Linear(300, 7))
    e = zo.estimate_memory(
        model, num_gpus=1, stage=1, offload_optimizer="cpu", moment_precision="8bit",
        dtype="float32",
    )  # fmt: skip
    sizes = [p.numel() for p in model.parameters()]
    pad = e.trainable_shard_numel - sum(sizes)
    master = 4 * e.trainable_shard_numel
    # every element has its code (unused where unquantized: element i of the run is entry
    # i), a quantized parameter an absmax per block, an unquantized one its fp32 moment
    moments = sum(
        n + (ABSMAX_BYTES * math.ceil(n / BLOCK) if n >= MIN_QUANTIZED_NUMEL else 4 * n)
        for n in sizes
    )
    expected = master + 2 * (moments + (1 + 4) * pad)
    assert _term(e, "optimizer state") == pytest.approx(expected, abs=1)


@pytest.mark.parametrize("fraction", [None, 0.5, "auto"])
@pytest.mark.parametrize("budget", [2 * 10**8, 2 * 10**9, 2 * 10**10])
def test_fp32_split_is_the_engines(fraction, budget):
    numel = 3 * 10**8
    ours = state_split(FP32_STATE, numel, 10**8, budget, 2, fraction)
    engine = optimizer_split(numel, 10**8, budget, 2, fraction)
    assert ours.split == engine
    assert ours.host_state_bytes == engine.host_state_bytes
    assert ours.disk_bytes_per_step() == engine.disk_bytes_per_step()
    assert ours.pipeline_bytes == engine.sizing.state_bytes()


def test_low_precision_split_holds_more_in_host_memory():
    """Under "auto", the spare budget holds as many sub-groups as fit at the policy's bytes."""
    numel, budget = 3 * 10**8, 2 * 10**9
    fp32 = state_split(FP32_STATE, numel, 10**8, budget, 2, "auto")
    small = StatePolicy(moments="8bit", master="bf16_sr")
    low = state_split(small, numel, 10**8, budget, 2, "auto")
    assert low.sizing == fp32.sizing
    assert low.host_numel > fp32.host_numel
    group = low.sizing.group
    spare = (
        budget - (low.sizing.host_bytes(numel, 2) - low.sizing.state_bytes()) - low.pipeline_bytes
    )
    assert low.host_state_bytes <= spare < low.host_state_bytes + low.state_bytes(group)


def test_nvme_space_and_disk_traffic_follow_the_policy():
    psi, n = 10**9, 4
    kw = dict(num_gpus=n, stage=3, offload_optimizer="nvme", host_available=10**12)
    fp32 = zo.estimate_memory(psi, **kw)
    low = zo.estimate_memory(psi, moment_precision="8bit", **kw)
    assert fp32.nvme_fraction == low.nvme_fraction == 1.0
    assert fp32.disk_bytes_per_step == 24 * psi // n
    assert low.disk_bytes_per_step == 2 * math.ceil(ROWS["8bit", "fp32"] * psi / n)
    assert low.disk_bytes_per_step <= 0.55 * fp32.disk_bytes_per_step
    assert _term(low, "optimizer state") == math.ceil(ROWS["8bit", "fp32"] * psi / n)


def test_bad_precision_is_a_config_error():
    with pytest.raises(zo.ConfigError, match="moment_precision"):
        zo.estimate_memory(10**9, num_gpus=1, stage=1, moment_precision="4bit")
    with pytest.raises(zo.ConfigError, match="Adagrad"):
        zo.estimate_memory(
            10**9, num_gpus=1, stage=1, optimizer_type="adagrad", moment_precision="8bit"
        )


def test_13b_stays_fp32_unless_lower_precision_is_allowed():
    p = zo.plan(13e9, **REFERENCE)
    assert p.fits and p.policy.is_default
    assert (p.choice.stage, p.choice.offload_optimizer) == (3, "nvme")
    assert "moment_precision" not in p.kwargs
    assert [r.label for r in p.states][0] == "fp32" and len(p.states) == 5
    smallest = p.states[-1]
    assert smallest.choice is not None and not smallest.choice.uses_nvme
    note = next(n for n in p.notes if "lower-precision" in n)
    assert "8-bit moments, bf16_sr master" in note and "allow_low_precision_states" in note
    assert "140.5 GB less" in note  # the fp32 plan's disk traffic per step, all saved


def test_13b_fits_with_no_nvme_when_allowed():
    p = zo.plan(13e9, **REFERENCE, allow_low_precision_states=True)
    assert p.fits
    c = p.choice
    assert (c.stage, c.offload_optimizer, c.offload_param) == (3, "cpu", "none")
    assert not c.uses_nvme and c.estimate.nvme_bytes_per_node == 0
    assert p.kwargs["moment_precision"] == "8bit" and p.kwargs["master_precision"] == "bf16_sr"
    assert "nvme_path" not in p.kwargs and not any("nvme_path" in n for n in p.notes)
    state = _term(c.estimate, "optimizer state") * c.estimate.ranks_per_node
    assert state == pytest.approx(ROWS["8bit", "bf16_sr"] * 13e9, rel=1e-6)
    assert state <= 65 * GB
    assert c.estimate.host_bytes_per_node <= 0.9 * REFERENCE["host_memory"]
    # the rows are the same whether or not lower precision is allowed
    assert [r.to_dict() for r in zo.plan(13e9, **REFERENCE).states] == [
        r.to_dict() for r in p.states
    ]


def test_allowed_keeps_fp32_where_it_needs_no_more_offload():
    """A model fp32 state fits without offload keeps fp32 even when lower is allowed."""
    p = zo.plan(
        1e8, num_gpus=1, gpu_memory=80 * GB, host_memory=None, allow_low_precision_states=True
    )
    assert p.policy.is_default and p.choice.offload_optimizer == "none"


def test_cli_rows_and_flag(capsys):
    args = [
        "plan",
        "--params",
        "13e9",
        "--gpus",
        "4",
        "--gpu-memory",
        "24GB",
        "--host-memory",
        "128GB",
    ]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "optimizer state (adamw)" in out and "--allow-low-precision-states" in out
    assert "zo.initialize(model, stage=3, offload_optimizer='nvme'" in out
    assert cli_main([*args, "--allow-low-precision-states"]) == 0
    out = capsys.readouterr().out
    assert "offload_optimizer='cpu'" in out and "moment_precision='8bit'" in out
    assert "master_precision='bf16_sr'" in out and "nvme_path" not in out
    assert cli_main([*args, "--allow-low-precision-states", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["moment_precision"] for r in data["optimizer_states"]] == [m for m, _ in ROWS]
    assert data["kwargs"]["master_precision"] == "bf16_sr"
    assert data["choice"]["nvme_bytes_per_node"] == 0
    assert cli_main([*args, "--optimizer", "lion"]) == 0
    assert "optimizer state (lion)" in capsys.readouterr().out


def test_default_estimate_unchanged_by_policy_keys():
    kw = dict(num_gpus=4, stage=3, offload_optimizer="nvme", offload_param="cpu")
    assert (
        zo.estimate_memory(13e9, **kw).terms
        == zo.estimate_memory(
            13e9, optimizer_type="adamw", moment_precision="fp32", master_precision="fp32", **kw
        ).terms
    )


def _small():
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


@pytest.mark.parametrize(("stage", "offload"), [(0, "none"), (1, "cpu"), (2, "cpu"), (2, "nvme")])
def test_fp32_compute_with_a_bf16_master_counts_the_staging(tmp_path, stage, offload):
    """fp32 compute with a bf16 master: the CPU optimizer writes the fp32 params into a
    buffer of its own (the master is not them), which the estimate counts."""
    import torch

    kw = dict(stage=stage, offload_optimizer=offload, dtype="float32", master_precision="bf16_sr")
    if offload == "nvme":
        kw["nvme_path"] = str(tmp_path)
    eng = zo.initialize(_small(), lr=1e-3, **kw)
    try:
        eng.backward(eng(torch.randn(4, 256)).pow(2).mean())
        eng.step()
        rep = eng.memory_report()
    finally:
        eng.close()
    kw.pop("nvme_path", None)
    with torch.device("meta"):
        model = _small()
    e = zo.estimate_memory(model, num_gpus=1, device="cpu", **kw)
    assert _term(e, "param staging") > 0
    for tier in ("device", "host"):
        assert rep.total(tier) == e.resident_bytes(tier), tier


def test_fp32_moment_params_are_estimated_as_the_engine_keeps_them():
    """``fp32_moment_params`` with 8-bit moments: the named parameters' moments stay fp32,
    in the engine and in the estimate from the model."""
    import torch

    kw = dict(stage=2, offload_optimizer="cpu", dtype="bfloat16", moment_precision="8bit")
    keep = ["0.weight"]
    eng = zo.initialize(_small(), lr=1e-3, fp32_moment_params=keep, **kw)
    try:
        eng.backward(eng(torch.randn(4, 256, dtype=torch.bfloat16)).float().pow(2).mean())
        eng.step()
        held = eng.memory_report().bytes["host"]["optimizer"]
    finally:
        eng.close()
    with torch.device("meta"):
        model = _small()
    e = zo.estimate_memory(model, num_gpus=1, device="cpu", fp32_moment_params=keep, **kw)
    quantized = zo.estimate_memory(model, num_gpus=1, device="cpu", **kw)
    assert _term(e, "optimizer state") > _term(quantized, "optimizer state")
    assert _term(e, "optimizer state") == held
