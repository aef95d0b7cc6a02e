"""fp32 compute with the optimizer beside the parameters: the fp32 parameters are the master.

No second fp32 copy of them is kept (stage 0, and stage 3 with resident parameter shards),
the step writes the parameters in place, and training matches ``torch.optim.AdamW``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_offload as zo
from equivalence import LR, WD, CLIP, GLOBAL_BATCH, compare, reference
from models import batch, loss_fn, make

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
