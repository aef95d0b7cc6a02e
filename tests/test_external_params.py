"""Models that use parameters outside their own module's forward train like torch AdamW at
stages 1-3 on every offload tier: ``nn.MultiheadAttention`` (reads ``out_proj`` without
calling it), ``nn.Transformer`` with a tied embedding and output projection, a head computing
``F.linear(x, self.embed.weight)``, and a block handed another module's weight. Stage 3 finds
the undeclared uses at run time (one warning), gathers them ahead from the next step on, and
takes declarations through ``zo.register_external_parameter``.

Each world size runs the whole matrix in one set of spawned gloo processes.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.distributed import run_ranks

import zero_offload as zo

LR, STEPS, GLOBAL_BATCH, VOCAB, WIDTH, SEQ = 1e-2, 3, 4, 32, 16, 5


# Attention without biases: the key bias's gradient is zero up to rounding, which Adam would
# turn into steps of either sign, so no two implementations would agree on it.
class MHANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True, bias=False)
        self.out = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        a, _ = self.attn(h, h, h)
        return self.out(a + h)


class TransformerLM(nn.Module):
    """Encoder-decoder ``nn.Transformer``; the output projection is the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(
            WIDTH,
            2,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=32,
            dropout=0.0,
            batch_first=True,
            bias=False,
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        out = self.transformer(self.embed(idx), self.embed(idx), tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


class FLinearHead(nn.Module):
    """A tied head written as ``F.linear(x, self.embed.weight)`` in the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.mid(self.embed(idx))), self.embed.weight)


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) + (h @ w) @ w.T


class Foreign(nn.Module):
    """``mix`` uses ``inp.weight``, a parameter of a module that ran before it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, 32)
        self.mix = Mixer()
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.mix(h, self.inp.weight))


MODELS = {"mha": MHANet, "transformer": TransformerLM, "flinear": FLinearHead, "foreign": Foreign}


def _batch(name: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name in ("transformer", "flinear"):
        idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        return idx[:, :-1], idx[:, 1:]
    x = (
        torch.randn(GLOBAL_BATCH, SEQ, WIDTH, generator=gen)
        if name == "mha"
        else torch.randn(GLOBAL_BATCH, WIDTH, generator=gen)
    )
    y = torch.randn(*x.shape[:-1], 8, generator=gen)
    return x, y


def _loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name in ("transformer", "flinear"):
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return F.mse_loss(out, y)


def _reference(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        x, y = _batch(name, gen)
        _loss(name, model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train(
    rank: int, world: int, name: str, stage: int, offload: str, root: str, declare: bool = False
) -> dict:
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = _reference(copy.deepcopy(model), name) if rank == 0 else None
    if declare:
        zo.register_external_parameter(model, model.embed.weight)
    kwargs = {"offload_optimizer": offload, "nvme_path": root}
    if stage == 3:
        kwargs["offload_param"] = offload
    count = _Count()
    logging.getLogger("zero_offload").addHandler(count)
    try:
        engine = zo.initialize(model, stage=stage, lr=LR, weight_decay=0.1, **kwargs)
        gen = torch.Generator().manual_seed(7)
        per = GLOBAL_BATCH // world
        on_demand = []
        for _ in range(STEPS):
            x, y = _batch(name, gen)
            sl = slice(rank * per, (rank + 1) * per)
            engine.backward(_loss(name, engine(x[sl]), y[sl]))
            engine.step()
            on_demand.append(engine._parts.gatherer.on_demand if engine._parts.gatherer else 0)
        sd = engine.full_state_dict()
        engine.close()
    finally:
        logging.getLogger("zero_offload").removeHandler(count)
    diff = None if ref is None else max((sd[k] - v).abs().max().item() for k, v in ref.items())
    return {
        "diff": diff,
        "on_demand": on_demand,
        "warnings": [m for m in count.messages if "register_external_parameter" in m],
    }


CASES = [
    (name, stage, offload)
    for name in MODELS
    for stage in (1, 2, 3)
    for offload in ("none", "cpu", "nvme")
]


def _matrix(rank: int, world: int, root: str) -> dict:
    out = {case: _train(rank, world, *case, root) for case in CASES}
    out["declared"] = _train(rank, world, "flinear", 3, "none", root, declare=True)
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as root:
        res = run_ranks(world, _matrix, root)
        assert os.listdir(root) == [], "swap files must be removed on close"
        return res


def _id(case):
    return "-".join(map(str, case))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_external_parameters_train_like_torch_adamw(world, case):
    r = results(world)[0][case]
    assert r["diff"] <= 0.03 * LR, f"max |diff| = {r['diff'] / LR:.4f} lr"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["flinear", "foreign"])
def test_undeclared_use_warns_once_and_is_gathered_ahead_from_the_next_step(world, name):
    for rank_result in results(world):
        r = rank_result[(name, 3, "none")]
        assert len(r["warnings"]) == 1, r["warnings"]
        # on demand in the first forward only; afterwards prefetched ahead of the use
        assert r["on_demand"][0] >= 1 and r["on_demand"][-1] == r["on_demand"][0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_declared_and_builtin_uses_need_no_on_demand_gather(world):
    for rank_result in results(world):
        declared = rank_result["declared"]
        assert declared["warnings"] == [] and declared["on_demand"][-1] == 0
        assert declared["diff"] is None or declared["diff"] <= 0.03 * LR
        for name in ("mha", "transformer"):  # out_proj is declared for MultiheadAttention
            r = rank_result[(name, 3, "cpu")]
            assert r["warnings"] == [] and r["on_demand"][-1] == 0


def test_register_external_parameter_rejects_what_is_not_a_parameter():
    model = FLinearHead()
    with pytest.raises(TypeError, match="nn.Parameter"):
        zo.register_external_parameter(model, model.embed.weight.detach())
    with pytest.raises(TypeError, match="nn.Module"):
        zo.register_external_parameter(model.embed.weight, model.embed.weight)


class CheckpointedMHA(MHANet):
    """The attention block recomputed in backward (``torch.utils.checkpoint``)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        a = torch.utils.checkpoint.checkpoint(
            lambda t: self.attn(t, t, t)[0], h, use_reentrant=self.reentrant
        )
        return self.out(a + h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputed_attention_gathers_out_proj_again(reentrant):
    torch.manual_seed(0)
    model = CheckpointedMHA(reentrant)
    ref = _reference(copy.deepcopy(model), "mha")
    engine = zo.initialize(model, stage=3, lr=LR, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        x, y = _batch("mha", gen)
        engine.backward(_loss("mha", engine(x), y))
        engine.step()
    sd = engine.full_state_dict()
    engine.close()
    worst = max((sd[k] - v).abs().max().item() for k, v in ref.items())
    assert worst <= 0.03 * LR, f"max |diff| = {worst / LR:.4f} lr"


class CheckpointedFLinearHead(FLinearHead):
    """The tied head recomputed in backward: the recomputation reads ``embed.weight``
    without calling ``embed``, in the backward pass, where it was released."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(idx)))
        return torch.utils.checkpoint.checkpoint(
            lambda t: F.linear(t, self.embed.weight), h, use_reentrant=self.reentrant
        )


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recomputation_reading_a_released_parameter_gathers_it(reentrant):
    torch.manual_seed(0)
    model = CheckpointedFLinearHead(reentrant)
    ref = _reference(copy.deepcopy(model), "flinear")
    engine = zo.initialize(model, stage=3, lr=LR, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        x, y = _batch("flinear", gen)
        engine.backward(_loss("flinear", engine(x), y))
        engine.step()
    sd = engine.full_state_dict()
    engine.close()
    worst = max((sd[k] - v).abs().max().item() for k, v in ref.items())
    assert worst <= 0.03 * LR, f"max |diff| = {worst / LR:.4f} lr"
