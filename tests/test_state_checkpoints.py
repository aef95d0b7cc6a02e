"""Checkpoints and ``engine.optimizer.state_dict()`` carry every optimizer kind and state
precision: a resume at the same world size and stage is bit for bit (the state is stored as
it is kept: 8-bit codes, absmax and side arrays, a bf16 master and its compensation); another
world size loads through fp32 (moments requantized within one quantization step) and says so;
another policy is refused, naming both and the fix, or converted on request;
``consolidate`` writes the fp32 master."""

from __future__ import annotations

import pytest
import torch
from support import state_ckpt_cases as C
from support.distributed import run_ranks

import zero_offload as zo
from zero_offload import CheckpointError, consolidate_checkpoint
from zero_offload.optim import quant

INT8_KAHAN = (
    ("master_precision", "bf16_kahan"),
    ("moment_precision", "8bit"),
    ("offload_optimizer", "cpu"),
    ("stage", 3),
)
LION_SR = (
    ("master_precision", "bf16_sr"),
    ("moment_precision", "8bit"),
    ("optimizer_type", "lion"),
    ("stage", 1),
)


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kwargs", [INT8_KAHAN, LION_SR], ids=["adamw8bit-kahan", "lion8bit-sr"])
def test_resume_is_bit_for_bit_on_one_process(tmp_path, kwargs):
    out = C.resume(0, 1, str(tmp_path), kwargs)
    _equal(out["straight"], out["resumed"])


@pytest.mark.multiprocess
def test_resume_on_two_ranks_then_reshard_to_one(tmp_path):
    for rank_out in run_ranks(2, C.resume, str(tmp_path), INT8_KAHAN):
        _equal(rank_out["straight"], rank_out["resumed"])
    # the checkpoint of step 3 (two ranks) on one rank: through fp32, and it says so
    one = C.reshard(0, 1, str(tmp_path), INT8_KAHAN)
    assert any("through fp32" in line for line in one["lines"]), one["lines"]
    from zero_offload.checkpoint.load import open_source

    source = open_source(tmp_path, "s3")
    gap = float(torch.diff(quant.dynamic_map(True)).max())  # the map's widest step
    try:
        for name, shape in source.shapes.items():
            n = int(torch.Size(shape).numel())
            saved = [torch.zeros(n) for _ in range(3)]
            source.read(name, 0, n, saved)
            mine = one[f"exp_avg.{name}"]
            # each block's absmax is at most the parameter's largest |m|
            assert (mine - saved[1]).abs().max() <= gap * saved[1].abs().max() + 1e-12, name
            # the master: fp32 sum of bf16 + compensation, split again into bf16 pairs
            torch.testing.assert_close(one["params"][name].flatten(), saved[0], rtol=2**-14, atol=0)
    finally:
        source.close()


def test_another_policy_is_refused_or_converted_on_request(tmp_path, caplog):
    data = C.batches(2)
    engine = C.build(**dict(INT8_KAHAN))
    C.train(engine, data)
    engine.save_checkpoint(tmp_path, tag="s2")
    saved = engine.full_state_dict()
    engine.close()
    other = C.build(stage=3, offload_optimizer="cpu")  # fp32 AdamW
    with pytest.raises(CheckpointError) as err:
        other.load_checkpoint(tmp_path, tag="s2")
    text = str(err.value)
    assert "8bit moments, bf16_kahan master" in text and "fp32 moments, fp32 master" in text
    assert "convert_state=True" in text and "moment_precision='8bit'" in text
    with caplog.at_level("INFO", logger="zero_offload.checkpoint.load"):
        other.load_checkpoint(tmp_path, tag="s2", convert_state=True)
    assert "through fp32" in caplog.text
    loaded = other.full_state_dict()
    for k in saved:  # the fp32 master the bf16 pair stood for
        torch.testing.assert_close(loaded[k], saved[k], rtol=0, atol=0)
    C.train(other, data[:1])
    other.close()


def test_consolidate_writes_the_fp32_master(tmp_path):
    engine = C.build(**dict(INT8_KAHAN))
    C.train(engine, C.batches(2))
    engine.save_checkpoint(tmp_path, tag="s2")
    full = engine.full_state_dict()
    engine.close()
    _equal(consolidate_checkpoint(tmp_path, "s2"), full)


@pytest.mark.parametrize("kwargs", [INT8_KAHAN, LION_SR], ids=["adamw8bit-kahan", "lion8bit-sr"])
def test_optimizer_state_dict_round_trips_bit_for_bit(kwargs):
    data = C.batches(4)
    engine = C.build(**dict(kwargs))
    C.train(engine, data[:2])
    state = engine.optimizer.state_dict()
    (entry,) = state["state"].values()
    assert entry["native"] and entry["zero_offload"]["policy"].startswith(
        dict(kwargs).get("optimizer_type", "adamw")
    )
    C.train(engine, data[2:])
    straight = engine.full_state_dict()
    engine.close()
    again = C.build(**dict(kwargs))
    again.optimizer.load_state_dict(state)
    C.train(again, data[2:])
    _equal(straight, again.full_state_dict())
    fp32 = C.build(stage=dict(kwargs)["stage"], offload_optimizer="cpu")
    with pytest.raises(ValueError, match="policy"):
        fp32.optimizer.load_state_dict(state)
    again.close()
    fp32.close()


def test_fp32_moment_params_keep_fp32_moments_and_resume_bit_for_bit(tmp_path):
    """bitsandbytes' 32-bit override as a keyword: the named parameter's moments are kept in
    fp32 (the side arrays grow by its elements), a resume is exact, and the names are part
    of the policy a checkpoint records."""
    big = [n for n, p in C.make_model(C.NAME).named_parameters() if p.numel() >= 4096]
    kept = dict(INT8_KAHAN, fp32_moment_params=[big[0]])
    out = C.resume(0, 1, str(tmp_path), tuple(kept.items()))
    _equal(out["straight"], out["resumed"])
    sizes = []
    for kwargs in (kept, dict(INT8_KAHAN)):
        engine = C.build(**kwargs)
        native = engine.optimizer.state_dict()["state"][0]["native"]
        sizes.append(sum(t.numel() for k, t in native.items() if k.endswith("side")))
        engine.close()
    numel = C.make_model(C.NAME).get_parameter(big[0]).numel()
    assert sizes[0] == sizes[1] + 2 * numel  # m and v of the kept parameter, in fp32
    other = C.build(**dict(INT8_KAHAN))
    with pytest.raises(CheckpointError, match="fp32_moment_params="):
        other.load_checkpoint(tmp_path, tag="s3")
    other.close()
    with pytest.raises(zo.ConfigError, match="fp32_moment_params names.*named_parameters"):
        C.build(**dict(INT8_KAHAN, fp32_moment_params=["no.such.weight"]))
