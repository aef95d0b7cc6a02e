"""Optimizer-state policy, per-shard layout and state tensors: bytes per component, block
boundaries where shards cut parameters, views without copies, fp32 round trips, config keys."""

from __future__ import annotations

import pytest
import torch

from zero_offload.config import ConfigError, OptimizerConfig, build_config
from zero_offload.optim import quant
from zero_offload.optim.layout import Piece, StateLayout
from zero_offload.optim.policy import (
    BLOCK,
    MIN_QUANTIZED_NUMEL,
    MasterPrecision,
    MomentPrecision,
    OptimizerKind,
    StatePolicy,
)
from zero_offload.optim.state import ShardState, buffer_bytes
from zero_offload.partition import build_layout

INT8 = StatePolicy(moments="8bit")
POLICIES = [
    StatePolicy(),
    INT8,
    StatePolicy("lion", "bf16", "bf16_sr"),
    StatePolicy("adamw", "8bit", "bf16_kahan"),
    StatePolicy("adagrad", "fp32", "bf16_kahan"),
]


def _units(num_shards: int):
    """Two units whose parameters are cut by shard boundaries at odd places."""
    a = build_layout([("w", (70, 130)), ("b", (100,)), ("u", (5000,))], num_shards)
    b = build_layout([("e", (8191,)), ("n", (3,))], num_shards)
    return a, b


def test_bytes_per_param_are_named_sums() -> None:
    assert StatePolicy().bytes_per_param == 12
    assert StatePolicy(moments="bf16").bytes_per_param == 8
    assert INT8.bytes_per_param == pytest.approx(4 + 2 * (1 + 4 / BLOCK))
    smallest = StatePolicy("adamw", "8bit", "bf16_sr")
    assert smallest.bytes_per_param < 5  # the 13B case's target: <= 5 bytes/param of state
    assert StatePolicy("lion", "8bit", "bf16_sr").bytes_per_param == pytest.approx(3 + 4 / BLOCK)
    assert StatePolicy(master="bf16_kahan").master.compensation_bytes == 2


def test_policy_values_and_errors() -> None:
    p = StatePolicy("LION", "int8", "kahan")
    assert (p.kind, p.moments, p.master) == (
        OptimizerKind.LION,
        MomentPrecision.INT8,
        MasterPrecision.BF16_KAHAN,
    )
    assert p.moment_names == ("exp_avg",)
    with pytest.raises(ValueError, match="moment_precision='4bit'.*'8bit'"):
        StatePolicy(moments="4bit")
    with pytest.raises(ValueError, match="Adagrad"):
        StatePolicy("adagrad", "bf16")


def test_config_keys_choose_the_policy_and_kind_defaults() -> None:
    assert OptimizerConfig().policy.is_default
    lion = OptimizerConfig(optimizer_type="lion", moment_precision="8bit")
    assert lion.betas == (0.9, 0.99) and lion.policy.quantized
    assert OptimizerConfig(optimizer_type="adagrad").eps == 1e-10
    assert OptimizerConfig(optimizer_type="lion", betas=(0.95, 0.98)).betas == (0.95, 0.98)
    with pytest.raises(ConfigError, match="master_precision='fp8'"):
        OptimizerConfig(master_precision="fp8")
    with pytest.raises(ConfigError, match="did you mean 'moment_precision'"):
        build_config(moments_precision="8bit")
    # every tier carries every policy
    assert build_config(optimizer_type="lion", stage=2, offload_optimizer="cpu").optimizer
    nvme = build_config(optimizer_type="lion", stage=3, offload_optimizer="nvme", nvme_path="/tmp")
    assert nvme.optimizer.policy.kind.value == "lion"


def test_blocks_start_at_each_parameter_and_shards_cut_them() -> None:
    for shards in (1, 2, 4):
        units = _units(shards)
        total_blocks = 0
        for rank in range(shards):
            lay = StateLayout.for_shards(INT8, [(u, rank) for u in units])
            assert lay.numel == sum(u.shard_numel for u in units)
            total_blocks += lay.blocks
            # every quantized piece belongs to a parameter of >= 4096 elements
            for seg in lay.segments:
                if seg.quantized:
                    assert seg.numel > 0
        # one rank: ceil(n / 256) blocks per large parameter, as bitsandbytes allocates
        if shards == 1:
            assert total_blocks == -(-9100 // BLOCK) + -(-5000 // BLOCK) + -(-8191 // BLOCK)
        else:
            assert total_blocks >= -(-9100 // BLOCK) + -(-5000 // BLOCK) + -(-8191 // BLOCK)


def test_small_tensors_and_padding_keep_fp32_moments() -> None:
    lay = StateLayout.build(
        INT8, [Piece(MIN_QUANTIZED_NUMEL - 1, 0, MIN_QUANTIZED_NUMEL - 1), Piece(0, 0, 9)]
    )
    assert lay.blocks == 0 and lay.side_numel == MIN_QUANTIZED_NUMEL + 8
    assert len(lay.segments) == 1  # merged: one run of fp32 moments


def test_parameters_named_in_fp32_moments_keep_fp32_moments() -> None:
    """bitsandbytes' per-parameter 32-bit override (Trainer's, for embeddings): the named
    large parameter keeps fp32 moments on every rank; the others are quantized as before."""
    keep = StatePolicy(moments="8bit", fp32_moments=frozenset({"u"}))
    assert keep != INT8 and "fp32 moments for 1 parameters" in keep.describe()
    assert StatePolicy(fp32_moments=frozenset({"u"})) == StatePolicy()  # fp32: nothing to keep
    for shards in (1, 2):
        for rank in range(shards):
            units = [(u, rank) for u in _units(shards)]
            plain, kept = (StateLayout.for_shards(p, units) for p in (INT8, keep))
            u_here = sum(
                o.numel for u, r in units for o in u.overlaps(r) if u.slots[o.slot].name == "u"
            )
            assert kept.side_numel == plain.side_numel + u_here
            assert kept.blocks < plain.blocks or u_here == 0


def test_span_bytes_add_up_over_any_boundary_cut() -> None:
    units = _units(2)
    lay = StateLayout.for_shards(INT8, [(u, 1) for u in units])
    whole = lay.span().component_bytes()
    cuts = sorted({lay.floor_boundary(x) for x in range(0, lay.numel, 997)} | {lay.numel})
    parts = [lay.span(a, b).component_bytes() for a, b in zip(cuts, cuts[1:])]
    for key in whole:
        assert sum(p[key] for p in parts) == whole[key]
    assert whole["master"] == 4 * lay.numel
    assert whole["exp_avg"] == lay.numel + 4 * lay.side_numel + 4 * lay.blocks
    with pytest.raises(ValueError, match="floor_boundary"):
        lay.span(0, lay.segments[0].start + 5 if lay.segments[0].quantized else 1 << 40)


def test_rows_cover_the_span_on_block_boundaries() -> None:
    units = _units(4)
    lay = StateLayout.for_shards(INT8, [(u, 2) for u in units])
    span = lay.span()
    rows = span.rows(chunk=512)
    assert rows[:, 1].sum() == span.numel
    assert (rows[1:, 0] == rows[:-1, 0] + rows[:-1, 1]).all()
    for off, n, _phase, _side, _block in rows:
        end = off + n
        assert lay.is_boundary(int(off)) and lay.is_boundary(int(end))
        assert n <= 512 + BLOCK


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe().split(" (")[0])
def test_buffer_views_narrow_and_fp32_round_trip(policy: StatePolicy) -> None:
    units = _units(2)
    lay = StateLayout.for_shards(policy, [(u, 0) for u in units])
    span = lay.span()
    gen = torch.Generator().manual_seed(0)
    values = {"master": torch.randn(lay.numel, generator=gen)}
    for name in policy.moment_names:
        x = torch.randn(lay.numel, generator=gen) * 1e-3
        values[name] = x.abs() if name != "exp_avg" else x
    state = ShardState.zeros(span)
    state.load_fp32(values)
    back = state.to_fp32()
    tol = {"fp32": 0.0, "bf16": 2**-8, "8bit": 0.02}[policy.moments.value]
    for name in policy.moment_names:
        err = (back[name] - values[name]).abs().max()
        assert err <= tol * values[name].abs().max() + 1e-12, name
    master_tol = {"fp32": 0.0, "bf16_kahan": 2**-15, "bf16_sr": 2**-8}[policy.master.value]
    assert ((back["master"] - values["master"]).abs() <= master_tol * values["master"].abs()).all()
    # a buffer holding the same bytes holds the same state
    buf = torch.zeros(buffer_bytes(span), dtype=torch.uint8)
    view = ShardState.from_buffer(span, buf)
    for (name, src), (_, dst) in zip(state.tensors(), view.tensors()):
        dst.copy_(src)
        assert dst.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), name
    assert all(torch.equal(a, b) for a, b in zip(view.to_fp32().values(), back.values()))
    # a sub-span's views alias the whole state's memory
    cut = lay.floor_boundary(lay.numel // 3)
    sub = state.narrow(lay.span(cut, lay.numel))
    sub.master.fill_(7.0)
    assert (state.master[cut:] == 7.0).all() and (state.master[:cut] != 7.0).any()
    for name in policy.moment_names:
        assert torch.equal(sub.moment_fp32(name), back[name][cut:])


def test_maps_match_bitsandbytes_and_nearest_rule() -> None:
    for signed in (True, False):
        code, t = quant.dynamic_map(signed), quant.thresholds(signed)
        assert code.numel() == 256 and t.numel() == 255
        x = torch.cat([torch.rand(4096) * (2 if signed else 1) - (1 if signed else 0), t])
        x = torch.cat([x, torch.nextafter(t, torch.tensor(-2.0))])
        nearest = (x[:, None] - code[None, :]).abs().argmin(dim=1)  # first minimum: tie low
        assert torch.equal(torch.bucketize(x, t, right=True), nearest)
    bnb = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes not installed")
    for signed in (True, False):
        assert torch.equal(quant.dynamic_map(signed), bnb.create_dynamic_map(signed=signed))


def test_torch_path_steps_fp32_adamw_like_torch() -> None:
    """The fallback's AdamW (what runs without a compiler) against torch.optim.AdamW."""
    from zero_offload.optim.step import StepHyper
    from zero_offload.optim.torch_step import torch_step

    lay = StateLayout.uniform(StatePolicy(), 10_000)
    state = ShardState.zeros(lay.span())
    p = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    state.master.copy_(p)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for s in range(1, 6):
        g = torch.randn(10_000)
        ref.grad = g.clone()
        opt.step()
        torch_step(state, g, StepHyper(step=s, lr=1e-2, weight_decay=0.1), None, 0)
    torch.testing.assert_close(state.master, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        state.moments["exp_avg_sq"].values, opt.state[ref]["exp_avg_sq"], rtol=1e-5, atol=0
    )
