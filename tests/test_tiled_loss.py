"""The tiled loss (``zero_offload.activations.tiled_loss``): the LM head and cross-entropy a
tile of the sequence at a time equal the plain loss up to the order of the sums, in value and
gradient (``gradcheck`` in fp64; a tiny Hugging Face Llama against its own ``.loss``, with
ignored labels and ``num_items_in_batch``; tied embeddings under stage 3), never hold the
full logits, and are what ``ZeroOffloadTrainer`` trains with under ``tiled_loss``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_trainer_worker import arguments, dataset, diff_lr
from hf_trainer_worker import make as make_trainer_model
from torch.utils._python_dispatch import TorchDispatchMode

import zero_offload as zo
from zero_offload.activations.tiled_loss import tiled_causal_lm_loss, tiled_lm_loss
from zero_offload.integrations.hf import ZeroOffloadTrainer

VOCAB = 96


def _plain(hidden, weight, labels, num_items=None):
    logits = F.linear(hidden, weight).float()
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        reduction="sum" if num_items is not None else "mean",
    )
    return loss / num_items if num_items is not None else loss


def test_gradcheck_fp64():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5), generator=gen)
    labels[0, 1] = -100
    torch.autograd.gradcheck(
        lambda h, w: tiled_lm_loss(h, w, labels, tile_tokens=3), (hidden, weight), fast_mode=True
    )


@pytest.mark.parametrize("tile, num_items", [(1, None), (7, 11), (64, None)])
def test_equals_the_plain_loss_up_to_summation_order(tile, num_items):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 9, 16, generator=gen, requires_grad=True)
    head = torch.nn.Linear(16, 40, bias=False)
    labels = torch.randint(0, 40, (3, 9), generator=gen)
    labels[:, :3] = -100  # a prompt the loss ignores
    want = _plain(hidden, head.weight, labels, num_items)
    want_grads = torch.autograd.grad(want, (hidden, head.weight))
    got = tiled_lm_loss(hidden, head, labels, tile_tokens=tile, num_items_in_batch=num_items)
    got_grads = torch.autograd.grad(got, (hidden, head.weight))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


class _LargestLogits(TorchDispatchMode):
    """The most rows of any float tensor ``vocab`` wide made while it is active."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2:
                if t.shape[-1] == self.vocab:
                    self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_the_full_logits_never_exist():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 64, 16, generator=gen, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    labels = torch.randint(0, 50, (2, 64), generator=gen)
    with _LargestLogits(50) as plain:
        _plain(hidden, head.weight, labels).backward()
    with _LargestLogits(50) as tiled:
        tiled_lm_loss(hidden, head, labels, tile_tokens=16).backward()
    assert plain.rows == 128 and tiled.rows == 16  # the weight's gradient is 16 x 50, too


def llama(tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def _tokens(gen):
    x = torch.randint(0, VOCAB, (2, 24), generator=gen)
    y = x.clone()
    y[:, :6] = -100
    return x, y


@pytest.mark.parametrize("num_items", [None, 30])
def test_hf_llama_loss_and_gradients_match_its_own(num_items):
    model = llama()
    x, y = _tokens(torch.Generator().manual_seed(3))
    want = model(input_ids=x, labels=y, num_items_in_batch=num_items).loss
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = tiled_causal_lm_loss(
        model, input_ids=x, labels=y, tile_tokens=10, num_items_in_batch=num_items
    )
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=1e-7, msg=n)


def test_tied_embeddings_at_stage_3_train_like_the_plain_loss():
    """The head is the input embedding: gathered for the tiles (no read the gatherer had to
    find at run time), regathered by the backward's recomputation, its gradient the sum of
    both uses."""
    runs = []
    for tiled in (False, True):
        model = llama(tied=True)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        engine = zo.initialize(model, stage=3, lr=1e-2)
        gen = torch.Generator().manual_seed(4)
        losses = []
        for _ in range(2):
            x, y = _tokens(gen)
            if tiled:
                loss = engine.run(
                    tiled_causal_lm_loss,
                    engine.module,
                    input_ids=x,
                    labels=y,
                    tile_tokens=16,
                    gather=engine.gathered,
                )
            else:
                loss = engine(input_ids=x, labels=y).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert not engine._parts.gatherer.learned  # no forward read it unannounced
        runs.append((losses, engine.full_state_dict()))
        engine.close()
    (want_losses, want), (losses, got) = runs
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


def test_trainer_trains_with_the_tiled_loss(tmp_path):
    """``tiled_loss`` in the trainer's config: the loss Trainer logs and the weights it trains
    are the plain loss's, and the head ran on no full sequence (its module is not called)."""
    results = []
    for tiles in (0, 8):
        model = make_trainer_model("llama")
        calls: list[int] = []
        model.lm_head.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            trainer = ZeroOffloadTrainer(
                model=model,
                args=arguments(str(tmp_path / str(tiles)), max_steps=2),
                train_dataset=dataset(),
                zero_offload=dict(stage=2, tiled_loss=tiles),
            )
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append((losses, trainer.engine.full_state_dict(), len(calls)))
        trainer.engine.close()
    (want_losses, want, plain_calls), (losses, got, tiled_calls) = results
    assert plain_calls > 0 and tiled_calls == 0
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert diff_lr(got, want) <= 1e-3


def test_a_model_that_scales_its_logits_is_refused(tmp_path):
    cfg = transformers.Gemma2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=30.0,
    )
    trainer = ZeroOffloadTrainer(
        model=transformers.Gemma2ForCausalLM(cfg),
        args=arguments(str(tmp_path), max_steps=1),
        train_dataset=dataset(),
        zero_offload=dict(stage=2, tiled_loss=True),
    )
    with pytest.raises(zo.ConfigError, match="final_logit_softcapping"):
        trainer.create_optimizer()
