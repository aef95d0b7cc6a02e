"""``engine(...)`` takes whatever ``model(...)`` takes, and the engine answers train()/eval()
like the model: namedtuples, PackedSequences, defaultdicts, dataclasses and mappings pass
through with their type, their tensors moved and cast to the compute dtype."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import zero_offload as zo

Pair = namedtuple("Pair", ["x", "scale"])


@dataclass
class Batch:
    x: torch.Tensor
    note: str = "kept"


class Seen(nn.Module):
    """Records the type of what it was called with; returns a loss-like scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: list = []

    def forward(self, inputs):
        self.seen.append(inputs)
        if isinstance(inputs, Pair):
            x = inputs.x * inputs.scale
        elif isinstance(inputs, Batch):
            x = inputs.x
        elif isinstance(inputs, PackedSequence):
            x = inputs.data
        else:
            x = inputs["x"]
        return self.lin(x).sum()


@pytest.mark.parametrize("stage", [0, 3])
def test_containers_keep_their_type_and_tensors_take_the_compute_dtype(stage):
    model = Seen()
    engine = zo.initialize(model, stage=stage, dtype=torch.bfloat16)
    x = torch.randn(3, 4)
    packed = pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 2]))
    dd = defaultdict(list, x=x)
    for value in (Pair(x, torch.tensor(2.0)), packed, dd, OrderedDict(x=x), Batch(x)):
        engine.backward(engine(value).float())
        got = model.seen[-1]
        assert type(got) is type(value)
    pair, seq, mapping, ordered, batch = model.seen
    assert pair.x.dtype == torch.bfloat16 and pair.scale.dtype == torch.bfloat16
    assert seq.data.dtype == torch.bfloat16 and seq.batch_sizes.dtype == torch.int64
    assert mapping.default_factory is list and mapping["x"].dtype == torch.bfloat16
    assert mapping["missing"] == [] and "missing" not in dd  # a copy, not the caller's
    assert list(ordered) == ["x"] and batch.note == "kept" and batch.x.dtype == torch.bfloat16
    assert engine.step()
    engine.close()


def test_non_tensor_and_integer_inputs_pass_through_unchanged():
    from zero_offload.engine.forward import move_inputs

    ids = torch.tensor([1, 2])
    value = {"ids": ids, "name": "a", "flags": (True, None)}
    assert move_inputs(value, torch.device("cpu"), torch.bfloat16) is value
    assert move_inputs(ids, torch.device("cpu"), torch.bfloat16) is ids


def test_train_and_eval_like_the_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    engine = zo.initialize(model, stage=2)
    assert engine.training and engine.module is model
    assert engine.eval() is engine and not model.training and not engine.training
    assert all(not m.training for m in model.modules())
    x = torch.randn(2, 4)
    torch.testing.assert_close(engine(x), engine(x))  # dropout off
    engine.train()
    assert model.training and engine.training
    engine.train(False)
    assert not model.training
    engine.close()
