"""The host gradient shard of an offloaded optimizer is kept in the compute dtype while each
element receives one reduced value per update (half the bytes of fp32, and exactly the values
fp32 would hold), and becomes fp32 as soon as a second value has to be summed into it (gradient
accumulation, several backwards before one step, late pieces), so sums stay fp32 as before."""

from __future__ import annotations

import pytest
import torch
from support import equivalence
from support.models import batch, loss_fn, make

import zero_offload as zo


def _host_grad_bytes(engine: zo.Engine) -> int:
    return engine.memory_report().bytes["host"]["grads"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_bf16_host_grads_without_accumulation(stage, offload, tmp_path):
    r = equivalence.run_case(
        0,
        1,
        "gpt",
        torch.bfloat16,
        stage,
        offload_optimizer=offload,
        nvme_path=tmp_path,
        sub_group_size=3000,
    )
    s = r.flat_shard
    assert r.report.bytes["host"]["grads"] == 2 * s  # bf16, not fp32
    assert r.clipped
    # the equivalence criterion for bf16 compute (tests/test_equivalence.py)
    assert r.max_diff_lr <= 8.0 and r.mean_diff <= 0.1 * equivalence.LR
    # and bit for bit what the same kernel gives with the gradients on the device
    none, _ = equivalence.train(0, 1, "gpt", torch.bfloat16, equivalence.STEPS, stage=stage)
    got, _ = equivalence.train(
        0,
        1,
        "gpt",
        torch.bfloat16,
        equivalence.STEPS,
        stage=stage,
        offload_optimizer=offload,
        nvme_path=tmp_path,
        sub_group_size=3000,
    )
    a, b = none.full_state_dict(), got.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for e in (none, got):
        e.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_sums_in_fp32(stage):
    r = equivalence.run_case(0, 1, "gpt", torch.bfloat16, stage, gas=2, offload_optimizer="cpu")
    assert r.report.bytes["host"]["grads"] == 4 * r.flat_shard
    assert r.max_diff_lr <= 8.0 and r.mean_diff <= 0.1 * equivalence.LR


def _two_backwards(gas: int, stage: int) -> dict[str, torch.Tensor]:
    """Two micro-batches per update: counted by the engine (gas=2), or by the caller with
    gas=1 (what the Trainer integrations do), with the loss divided by 2 by hand."""
    torch.manual_seed(0)
    engine = zo.initialize(
        make("gpt"),
        stage=stage,
        dtype=torch.bfloat16,
        lr=1e-2,
        max_grad_norm=0.05,
        offload_optimizer="cpu",
        gradient_accumulation_steps=gas,
    )
    gen = torch.Generator().manual_seed(1234)
    for _ in range(3):
        for micro in range(2):
            x, y = batch("gpt", 4, gen)
            loss = loss_fn("gpt", engine(x), y)
            if gas == 1:
                engine.backward(loss / 2, final=micro == 1)
            else:
                engine.backward(loss)
            engine.step() if gas == 2 or micro == 1 else None
    assert _host_grad_bytes(engine) == 4 * engine.trainable_numel  # became fp32
    out = engine.full_state_dict()
    engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_second_backward_widens_the_host_grads_to_fp32(stage):
    """The first piece is exact in bf16; widening it before the second is summed gives the
    fp32 sums that fp32 gradients from the start give, bit for bit."""
    a, b = _two_backwards(2, stage), _two_backwards(1, stage)
    assert all(torch.equal(a[k], b[k]) for k in a)
