"""UnitStates, the one owner of what units are doing: gather transitions with the values they
bring, the gradients a unit owes in a backward, and the engine's training state."""

from __future__ import annotations

import torch
import torch.nn as nn

from zero_offload.comm import Comm
from zero_offload.device.streams import Streams
from zero_offload.params.unit_state import GatherState, TrainingState, UnitStates
from zero_offload.params.units import FlatUnit
from zero_offload.partition import build_layout


def _unit(index: int, sharded: bool, trainable: int = 2) -> FlatUnit:
    layout = build_layout([(f"w{i}", torch.Size([5])) for i in range(3)], num_shards=1)
    full = torch.zeros(layout.padded_numel)
    views = layout.views(full)
    params = [nn.Parameter(v, requires_grad=i < trainable) for i, v in enumerate(views)]
    unit = FlatUnit(
        index, params, [f"w{i}" for i in range(3)], layout, full, 0, sharded, views=views
    )
    if sharded:  # as build_units leaves it once its shard is stored
        unit.full.untyped_storage().resize_(0)
    return unit


def test_gather_wait_free_move_a_unit_through_its_states() -> None:
    unit, kept = _unit(0, sharded=True), _unit(1, sharded=False)
    states = UnitStates([unit, kept], Comm(), Streams(torch.device("cpu")))
    assert states.gather_state(unit) is GatherState.FREE
    assert states.gather_state(kept) is GatherState.GATHERED
    shard = torch.arange(unit.layout.padded_numel, dtype=torch.float32)

    assert states.gather(unit, shard, wait=False)
    assert states.gather_state(unit) is GatherState.PENDING
    assert not states.gather(unit, shard, wait=False)  # issued once
    states.wait(unit)
    assert states.gather_state(unit) is GatherState.GATHERED
    torch.testing.assert_close(unit.params[1].detach(), shard[5:10])  # the views see it

    assert states.free(unit) and not states.free(unit)
    assert states.gather_state(unit) is GatherState.FREE
    assert unit.full.untyped_storage().size() == 0
    assert not states.free(kept)  # a persistent unit keeps its memory
    assert states.gather(unit, shard + 1, wait=True)
    assert states.gather_state(unit) is GatherState.GATHERED
    torch.testing.assert_close(unit.full, shard + 1)


def test_a_unit_is_done_with_its_last_trainable_gradient_once() -> None:
    unit = _unit(0, sharded=False, trainable=2)
    states = UnitStates([unit], Comm(), Streams(torch.device("cpu")))
    assert states.training is TrainingState.IDLE and states.final
    states.begin_forward()
    assert states.in_forward and not states.in_backward
    states.end_pass()
    for final in (False, True):  # every backward owes the gradients again
        states.begin_backward(final)
        assert states.in_backward and not states.in_forward and states.final is final
        assert not states.grads_reduced(unit)
        assert not states.grad_arrived(unit)  # one of two
        assert states.grad_arrived(unit) and states.grads_reduced(unit)
        assert not states.mark_reduced(unit)  # the end of backward does not reduce it again
        states.end_pass()
        assert states.training is TrainingState.IDLE
    states.begin_backward(False)
    assert states.mark_reduced(unit)  # not used this backward: reduced at its end
    states.begin_step()
    assert states.final and states.training is TrainingState.IDLE
