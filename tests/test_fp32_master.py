"""fp32 compute with the optimizer beside the parameters: the fp32 parameters are the master.

No second fp32 copy of them is kept (stage 0, and stage 3 with resident parameter shards),
the step writes the parameters in place, and training matches ``torch.optim.AdamW``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.equivalence import CLIP, GLOBAL_BATCH, LR, WD, compare, reference
from support.models import batch, loss_fn, make

import zero_offload as zo

STEPS = 4


def _storages(tensors) -> dict[int, int]:
    """data_ptr of each distinct storage -> its bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _train(stage: int) -> tuple[zo.Engine, torch.nn.Module]:
    torch.manual_seed(0)
    model = make("gpt")
    initial = copy.deepcopy(model)
    engine = zo.initialize(
        model, stage=stage, dtype=torch.float32, lr=LR, weight_decay=WD, max_grad_norm=CLIP
    )
    gen = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        x, y = batch("gpt", GLOBAL_BATCH, gen)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
    return engine, initial


@pytest.mark.parametrize("stage", [0, 3])
def test_fp32_params_are_the_master(stage):
    engine, initial = _train(stage)
    n = engine.trainable_numel
    held = engine.optimizer_tensors()
    params = [p for p in engine.module.parameters()]
    param_storages = _storages(params) if stage == 0 else _storages([engine.param_store.resident])
    # the master is the parameters' own memory, not a copy of it
    assert held["master"].untyped_storage().data_ptr() in param_storages
    # fp32 bytes held besides the gradients: params + m + v, nothing more
    report = engine.memory_report()
    assert report.total(kind="optimizer") == 2 * 4 * n  # exp_avg + exp_avg_sq
    fp32 = _storages(
        list(held.values())
        + [engine.grads]
        + ([engine.param_store.resident] if stage == 3 else params)
    )
    assert sum(fp32.values()) == sum(param_storages.values()) + 3 * 4 * n  # + m, v, grads
    # and it trains as torch's AdamW does
    max_diff, mean_diff = compare(
        engine.full_state_dict(), reference(initial, "gpt", torch.float32, STEPS)
    )
    assert max_diff <= 0.03 and mean_diff <= 1e-6
    # the parameters the model computes with are the stepped ones
    sd = engine.full_state_dict()
    for name, p in engine.module.named_parameters():
        if stage == 0:
            assert torch.equal(p.detach(), sd[name])
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage0_autograd_sums_into_the_gradient_buffer(dtype):
    """Stage 0: each param.grad is its view of the engine's gradient buffer, so backward
    holds the gradients once (not autograd's tensors beside the buffer, copied at the step),
    and the report counts them once."""
    torch.manual_seed(0)
    engine = zo.initialize(make("gpt"), stage=0, dtype=dtype, lr=LR)
    x, y = batch("gpt", GLOBAL_BATCH, torch.Generator().manual_seed(0))
    engine.backward(loss_fn("gpt", engine(x), y))
    buffer = engine.grads.untyped_storage().data_ptr()
    grads = [p.grad for p in engine.module.parameters()]
    assert all(g is not None and g.untyped_storage().data_ptr() == buffer for g in grads)
    assert engine.grads.abs().sum() > 0  # the values are in the buffer already
    n = engine.trainable_numel
    assert engine.memory_report().bytes["device"]["grads"] == n * engine.grads.element_size()
    engine.close(hand_back=False)  # the model keeps no view of the closed engine's buffer
    assert all(p.grad is None for p in engine.module.parameters())


def test_stage0_gradients_dropped_by_the_caller_are_not_applied():
    """A param whose .grad the loop sets to None after backward is not stepped (as
    torch.optim.AdamW skips it), and one whose .grad it replaces steps with the new value."""
    torch.manual_seed(0)
    model = make("gpt")
    initial = copy.deepcopy(model)
    engine = zo.initialize(model, stage=0, dtype=torch.float32, lr=LR, weight_decay=WD)
    ref_opt = torch.optim.AdamW(initial.parameters(), lr=LR, weight_decay=WD)
    x, y = batch("gpt", GLOBAL_BATCH, torch.Generator().manual_seed(0))
    engine.backward(loss_fn("gpt", engine(x), y))
    loss_fn("gpt", initial(x), y).backward()
    names = [n for n, _ in model.named_parameters()]
    dropped, replaced = names[0], names[1]
    for m in (model, initial):
        params = dict(m.named_parameters())
        params[dropped].grad = None
        params[replaced].grad = torch.full_like(params[replaced], 0.5)
    engine.step()
    ref_opt.step()
    sd = engine.full_state_dict()
    for name, p in initial.named_parameters():
        torch.testing.assert_close(sd[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    engine.close()
