"""``no_decay``: parameters stepped without weight decay (biases and norm weights, the group
Hugging Face Trainer and most recipes build), in every stage and optimizer tier, against torch
AdamW with two parameter groups — also when some parameters miss updates (their ranges carry
both their own step count and their decay)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import zero_offload as zo

LR, WD = 1e-2, 0.5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(48, 48), nn.Linear(48, 48)
        self.norm = nn.LayerNorm(48)
        self.c = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.c(self.norm(h))


NO_DECAY = ["a.bias", "b.bias", "norm.weight", "norm.bias", "c.bias"]
SCRIPT = [True, False, True, True]  # whether module b runs (False: b gets no gradient)


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 48, generator=torch.Generator().manual_seed(i))


def _torch(model: nn.Module, no_decay: list[str]) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named.items() if n not in no_decay]},
            {"params": [named[n] for n in no_decay], "weight_decay": 0.0},
        ],
        lr=LR,
        weight_decay=WD,
    )
    for i, use_b in enumerate(SCRIPT):
        model(_x(i), use_b).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


CASES = [(0, "none"), (2, "none"), (2, "cpu"), (2, "nvme"), (3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("stage,offload", CASES)
def test_no_decay_parameters_match_torch_adamw_groups(tmp_path, stage, offload):
    torch.manual_seed(0)
    model = Net()
    ref = _torch(copy.deepcopy(model), NO_DECAY)
    everything = _torch(copy.deepcopy(model), []) if stage == 0 else None
    engine = zo.initialize(
        model,
        stage=stage,
        offload_optimizer=offload,
        offload_param="cpu" if stage == 3 else "none",
        nvme_path=tmp_path if offload == "nvme" else None,
        sub_group_size=1000,
        lr=LR,
        weight_decay=WD,
        no_decay=NO_DECAY,
        dtype=torch.float32,
    )
    for i, use_b in enumerate(SCRIPT):
        engine.backward(engine(_x(i), use_b).square().mean())
        engine.step()
    got = engine.full_state_dict()
    engine.close()
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref) / LR
    assert worst <= 1e-3, f"max |engine - torch| = {worst:.4f} lr"
    if everything is not None:  # the test can tell: decaying all of them differs
        assert max((everything[k] - ref[k]).abs().max().item() for k in ref) / LR > 0.05


def test_unknown_no_decay_name_is_a_config_error():
    with pytest.raises(zo.ConfigError, match="no_decay.*named_parameters"):
        zo.initialize(Net(), stage=2, no_decay=["a.bias", "nonexistent.bias"])
    with pytest.raises(zo.ConfigError, match="no_decay"):
        zo.initialize(Net(), stage=2, no_decay="a.bias")
