"""Both NVMe updaters step through one sub-group pipeline, so a state policy other than fp32
AdamW fails as fp32 AdamW does: a step whose I/O fails after some sub-groups changed raises
``IncompleteStepError`` (caused by the disk's error) and refuses every later step and state
read until a checkpoint is loaded; after that it trains like an engine that never failed."""

from __future__ import annotations

import errno

import pytest
import torch
from support.models import MLP, batch, loss_fn
from support.swap_faults import FaultBackend

import zero_offload as zo
from zero_offload.swap import SwapIOError

INT8 = dict(moment_precision="8bit")


def _run(engine, steps: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = batch("mlp", 4, gen)
        engine.backward(loss_fn("mlp", engine(x), y))
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("op", ["read", "write"])
def test_8bit_state_failing_halfway_refuses_to_train_on_until_load_checkpoint(tmp_path, op):
    torch.manual_seed(0)
    engine = zo.initialize(
        MLP(),
        stage=2,
        offload_optimizer="nvme",
        nvme_path=tmp_path / "nvme",
        sub_group_size=1024,
        step_during_backward=False,  # the fault counts I/O calls: all of them the step's
        **INT8,
    )
    assert engine.optimizer_split is not None
    _run(engine, steps=1)
    engine.save_checkpoint(tmp_path / "ck")
    swap_io = engine.swappers[0].engine
    swap_io.backend = FaultBackend(op, errno_=errno.EIO, after=1)
    x, y = batch("mlp", 4, torch.Generator().manual_seed(1))
    engine.backward(loss_fn("mlp", engine(x), y))
    with pytest.raises(zo.IncompleteStepError, match=r"NVMe sub-groups.*load_checkpoint") as err:
        engine.step()
    assert isinstance(err.value.__cause__, SwapIOError)
    swap_io.backend = FaultBackend("none")
    engine.zero_grad()
    engine.backward(loss_fn("mlp", engine(x), y))
    with pytest.raises(zo.IncompleteStepError, match="load_checkpoint"):
        engine.step()
    with pytest.raises(zo.IncompleteStepError, match="load_checkpoint"):
        engine.full_state_dict()
    engine.load_checkpoint(tmp_path / "ck")
    assert engine.optimizer_steps == 1
    got = _run(engine, steps=2, seed=5)
    torch.manual_seed(0)
    ref = zo.initialize(MLP(), stage=2, offload_optimizer="cpu", **INT8)
    _run(ref, steps=1)
    want = _run(ref, steps=2, seed=5)
    assert all(torch.equal(want[k], got[k]) for k in want)
    engine.close()
    ref.close()
