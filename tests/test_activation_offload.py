"""Activation offload (``offload_activations``): results equal bit for bit to offload off, at
every stage, under both kinds of ``torch.utils.checkpoint`` and Hugging Face's
``gradient_checkpointing_enable()``, on one and two ranks; what it takes, what it frees, and
what it does when the host budget runs out."""

from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import transformers
from support.distributed import run_ranks
from torch.utils.checkpoint import checkpoint

import zero_offload as zo
from zero_offload.activations.config import ActivationConfig
from zero_offload.activations.host_slots import slot_bytes
from zero_offload.activations.offload import ActivationOffload
from zero_offload.device.streams import Streams
from zero_offload.rehearsal import rehearse

WIDTH, LAYERS = 32, 4


class Stack(nn.Module):
    """A stem, then ``LAYERS`` blocks each run under ``torch.utils.checkpoint`` (reentrant or
    not; ``None``: no checkpointing)."""

    def __init__(self, reentrant: bool | None, width: int = WIDTH) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x.square().mean()


def _train(model: nn.Module, steps: int = 2, **kwargs) -> tuple[dict, list, zo.Engine]:
    engine = zo.initialize(model, lr=1e-2, **kwargs)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(16, WIDTH, generator=gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine.full_state_dict(), losses, engine


def _stack(reentrant: bool | None) -> Stack:
    torch.manual_seed(0)
    return Stack(reentrant)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_inputs_offloaded_bit_equal(stage, reentrant):
    want, want_losses, plain = _train(_stack(reentrant), stage=stage)
    plain.close()
    got, losses, engine = _train(
        _stack(reentrant), stage=stage, offload_activations=True, offload_activations_min_bytes=0
    )
    assert losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    offload = engine._parts.activations
    assert offload.offloaded == LAYERS  # exactly the blocks' inputs, nothing else
    assert engine.last_step["activations_offloaded_bytes"] == LAYERS * 16 * WIDTH * 4
    assert engine.last_step["activations_fetched_late"] == 0  # each brought back ahead
    assert offload.host_bytes == 0 and offload.slots.held == 0  # all given back
    assert engine.memory_report().bytes["host"]["activations"] == offload.slots.capacity > 0
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_every_saved_tensor_offloaded_bit_equal(stage):
    """``offload_activations='all'`` without checkpointing: every saved activation moves,
    parameters stay (stage 3's gatherer still re-gathers the ones autograd saved)."""
    want, want_losses, plain = _train(_stack(None), stage=stage)
    plain.close()
    got, losses, engine = _train(
        _stack(None), stage=stage, offload_activations="all", offload_activations_min_bytes=0
    )
    assert losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert engine._parts.activations.offloaded >= 2 * LAYERS
    engine.close()


def test_one_copy_per_storage_and_views_come_back_as_they_were():
    """A storage saved twice (``x * x``) and through a transposed view is copied once and
    each saved tensor comes back with its own strides."""
    offload = ActivationOffload(
        ActivationConfig(mode="all", min_bytes=0), Streams(torch.device("cpu")), 1 << 20
    )
    w = nn.Parameter(torch.randn(8, 8))  # a parameter: never offloaded
    x0 = torch.randn(8, 8, requires_grad=True)
    seen = []
    with offload.forward():
        x = x0 * 2
        y = (x * x).sum() + (x.t() @ w).sum()
        seen.append(offload.offloaded)
    y.backward()
    ref_w, ref_x = w.grad.clone(), x0.grad.clone()
    w.grad = x0.grad = None
    x = x0 * 2
    ((x * x).sum() + (x.t() @ w).sum()).backward()
    assert torch.equal(w.grad, ref_w) and torch.equal(x0.grad, ref_x)
    assert seen == [1]  # x, saved three times (twice by mul, once transposed by mm)


def test_a_full_host_budget_keeps_the_rest_on_the_device(caplog):
    limit = 2 * slot_bytes(16 * WIDTH * 4)  # room for two of the four block inputs
    want, want_losses, plain = _train(_stack(False), stage=2)
    plain.close()
    with caplog.at_level(logging.WARNING, logger="zero_offload.activations.offload"):
        got, losses, engine = _train(
            _stack(False),
            stage=2,
            offload_activations=True,
            offload_activations_min_bytes=0,
            host_memory_limit=limit,
        )
    assert losses == want_losses and all(torch.equal(got[k], want[k]) for k in want)
    assert engine._parts.activations.offloaded == 2
    assert engine.last_step["activations_kept_bytes"] == 2 * 16 * WIDTH * 4
    assert engine.memory_report().bytes["host"]["activations"] <= limit
    assert "host_memory_limit" in caplog.text
    engine.close()


def test_checkpoints_mode_without_checkpointing_says_what_to_do(caplog):
    with caplog.at_level(logging.WARNING, logger="zero_offload.activations.offload"):
        _, _, engine = _train(_stack(None), steps=1, offload_activations=True)
    assert engine._parts.activations.offloaded == 0
    assert "gradient_checkpointing_enable" in caplog.text and "'all'" in caplog.text
    engine.close()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(offload_activations="cpu"), "'checkpoints'"),
        (dict(offload_activations_prefetch=0), "offload_activations_prefetch=0"),
        (dict(offload_activations_min_bytes=-1), ">= 0"),
        (dict(tiled_loss=1.5), "tiled_loss=1.5"),
    ],
)
def test_bad_activation_keywords_are_named(kwargs, words):
    with pytest.raises(zo.ConfigError, match=words):
        zo.build_config(**kwargs)


# -- a tiny Hugging Face Llama under gradient_checkpointing_enable() ---------------------------
def tiny_llama(reentrant: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg).train()
    with warnings.catch_warnings():  # transformers 5 renamed it activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    if reentrant:  # the inputs of a reentrant region must require grad (HF's own advice)
        model.enable_input_require_grads()
    return model


ALL = [(stage, reentrant) for stage in (0, 1, 2, 3) for reentrant in (True, False)]


def _llama_cases(rank: int, world: int, cases: list[tuple]) -> list[tuple]:
    """Each (stage, reentrant) case trained one step with offload off, then on; (case,
    loss, parameters, storages the forward offloaded) per run."""
    out = []
    for stage, reentrant in cases:
        for on in (False, True):
            kw = dict(offload_activations=True, offload_activations_min_bytes=0) if on else {}
            engine = zo.initialize(tiny_llama(reentrant), stage=stage, lr=1e-2, **kw)
            x = torch.randint(0, 96, (2 * world, 16), generator=torch.Generator().manual_seed(7))
            x = x[2 * rank : 2 * rank + 2]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            offloaded = engine._parts.activations.offloaded if on else 0
            out.append(((stage, reentrant, on), loss.item(), engine.full_state_dict(), offloaded))
            engine.close()
    return out


def _assert_offload_changes_nothing(runs: list[tuple]) -> None:
    for off, on in zip(runs[::2], runs[1::2]):
        (stage, reentrant, _), loss, params, _ = off
        assert on[0] == (stage, reentrant, True)
        assert on[1] == loss, (stage, reentrant)
        assert all(torch.equal(on[2][k], params[k]) for k in params), (stage, reentrant)
        assert on[3] == 2, (stage, reentrant)  # the two decoder layers' inputs


def test_hf_llama_one_rank():
    _assert_offload_changes_nothing(_llama_cases(0, 1, ALL))


@functools.lru_cache(maxsize=None)
def _two_rank_runs() -> list[list[tuple]]:
    """Every case on two ranks, in one spawn (the tests below check one kind each)."""
    return run_ranks(2, _llama_cases, ALL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_hf_llama_two_ranks(reentrant):
    """Every stage on two ranks, under each kind of checkpointing."""
    results = [[run for run in runs if run[0][1] == reentrant] for runs in _two_rank_runs()]
    assert [len(runs) for runs in results] == [8, 8]  # 4 stages, offload off and on
    for runs in results:
        _assert_offload_changes_nothing(runs)
    for a, b in zip(*results):  # the ranks agree on the parameters they trained
        assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])


# -- the simulated GPU --------------------------------------------------------------------------
def test_rehearsal_sees_offloaded_inputs_leave_the_device():
    """On the rehearsal's simulated device the block inputs go to host buffers: the forward's
    peak falls by all but the few in flight, and the host holds them."""
    width, rows = 1024, 512
    block_input = rows * width * 4

    def measured(**kwargs):
        with torch.device("meta"):
            model = Stack(False, width)
        r = rehearse(
            model,
            world_size=1,
            gpu_memory=8 << 30,
            batch=lambda: (torch.empty(rows, width, device="meta"),),
            loss_fn=lambda out: out,
            iterations=1,
            **kwargs,
        )
        assert r.failure is None, r.failure
        return r.phases["forward"]

    plain = measured()
    off = measured(offload_activations=True, offload_activations_min_bytes=0)
    assert off.host_peak - plain.host_peak >= LAYERS * block_input
    assert plain.device_peak - off.device_peak >= (LAYERS - 2) * block_input
    assert off.d2h_bytes >= LAYERS * block_input
