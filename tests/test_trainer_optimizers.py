"""The optimizers the trainer integrations accept (integrations/optimizers.py): Hugging Face
``TrainingArguments.optim`` names and the classes Lightning's ``configure_optimizers`` may
return (torch, bitsandbytes, torchao) mapped to the engine's ``optimizer_type`` and
``moment_precision``; anything else a ConfigError that lists what is supported. Then two
steps through ZeroOffloadTrainer and the Lightning strategy with Lion and 8-bit AdamW."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn

import zero_offload as zo
from zero_offload.config import OptimizerConfig
from zero_offload.integrations.lightning_optimizers import hyperparameters
from zero_offload.integrations.optimizers import HF_OPTIMS, hf_optim_keys, optimizer_keys

warnings.filterwarnings("ignore", category=FutureWarning)
HF_EXPECTED = {
    "adamw_torch": ("adamw", "fp32"),
    "adamw_torch_fused": ("adamw", "fp32"),
    "adamw_torch_8bit": ("adamw", "8bit"),
    "adamw_bnb_8bit": ("adamw", "8bit"),
    "adamw_8bit": ("adamw", "8bit"),
    "paged_adamw_8bit": ("adamw", "8bit"),
    "paged_adamw_32bit": ("adamw", "fp32"),
    "lion_32bit": ("lion", "fp32"),
    "lion_8bit": ("lion", "8bit"),
    "paged_lion_32bit": ("lion", "fp32"),
    "paged_lion_8bit": ("lion", "8bit"),
    "adagrad": ("adagrad", "fp32"),
}


def _policy(keys: dict[str, str]) -> tuple[str, str]:
    p = OptimizerConfig(**keys).policy  # the keys are valid config keywords
    assert p.master.value == "fp32"  # as in the optimizers they stand for
    return p.kind.value, p.moments.value


@pytest.mark.parametrize("name", sorted(HF_EXPECTED))
def test_hf_optim_names(name):
    assert _policy(hf_optim_keys(name)) == HF_EXPECTED[name]


def test_hf_names_are_transformers_own():
    """Every name mapped is one the installed transformers offers (adamw_hf: older ones)."""
    from transformers.training_args import OptimizerNames

    offered = {o.value for o in OptimizerNames}
    assert set(HF_OPTIMS) - offered <= {"adamw_hf"}
    assert set(HF_EXPECTED) <= offered


@pytest.mark.parametrize("name", ["sgd", "adafactor", "adamw_torch_4bit", "ademamix_8bit"])
def test_hf_other_optims_list_what_is_supported(name):
    with pytest.raises(zo.ConfigError) as err:
        hf_optim_keys(name)
    text = str(err.value)
    assert f"optim={name!r} is not supported" in text
    for accepted in ("'adamw_torch'", "'adamw_torch_8bit'", "'lion_32bit'", "'lion_8bit'"):
        assert accepted in text


def test_hf_engine_keywords_carry_the_optim():
    pytest.importorskip("transformers")
    from hf_trainer_worker import arguments, make

    from zero_offload.integrations.hf import engine_keywords

    model = make("llama")
    kw = engine_keywords(arguments("unused", optim="lion_8bit"), model, dict(stage=2))
    assert kw["optimizer_type"] == "lion" and kw["moment_precision"] == "8bit"
    assert kw["betas"] == (0.9, 0.999)  # Trainer gives Lion adam_beta1, adam_beta2
    kw = engine_keywords(arguments("unused", optim="adagrad"), model, dict(stage=2))
    assert kw["optimizer_type"] == "adagrad" and "betas" not in kw and "eps" not in kw
    kw = engine_keywords(arguments("unused"), model, dict(stage=2))
    assert "optimizer_type" not in kw  # AdamW: the defaults
    with pytest.raises(zo.ConfigError, match="'lion_8bit'"):
        engine_keywords(arguments("unused", optim="sgd"), model, dict(stage=2))


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(8192)), nn.Parameter(torch.zeros(16))]


def test_torch_classes():
    assert optimizer_keys(torch.optim.AdamW(_params())) == {}
    assert optimizer_keys(torch.optim.Adam(_params())) == {}  # no decay: AdamW's update
    assert _policy(optimizer_keys(torch.optim.Adam(_params(), weight_decay=0.1))) == (
        "adam",
        "fp32",
    )
    assert _policy(optimizer_keys(torch.optim.Adagrad(_params()))) == ("adagrad", "fp32")

    class MyAdamW(torch.optim.AdamW):
        pass

    assert optimizer_keys(MyAdamW(_params())) == {}
    with pytest.raises(zo.ConfigError, match="lr_decay"):
        optimizer_keys(torch.optim.Adagrad(_params(), lr_decay=0.1))


def test_other_classes_list_what_is_supported():
    with pytest.raises(zo.ConfigError) as err:
        optimizer_keys(torch.optim.SGD(_params(), lr=0.1))
    text = str(err.value)
    assert "configure_optimizers returned SGD" in text
    for accepted in (
        "torch.AdamW",
        "torch.Adagrad",
        "bitsandbytes.AdamW8bit",
        "bitsandbytes.Lion8bit",
        "torchao.AdamW8bit",
    ):
        assert accepted in text


def test_bitsandbytes_classes():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed (dev extra)")
    cases = {
        bnb.optim.AdamW8bit: ("adamw", "8bit"),
        bnb.optim.Adam8bit: ("adamw", "8bit"),  # bitsandbytes' Adam decays decoupled
        bnb.optim.PagedAdamW8bit: ("adamw", "8bit"),
        bnb.optim.AdamW: ("adamw", "fp32"),
        bnb.optim.Lion: ("lion", "fp32"),
        bnb.optim.Lion8bit: ("lion", "8bit"),
        bnb.optim.Adagrad: ("adagrad", "fp32"),
    }
    for cls, want in cases.items():
        assert _policy(optimizer_keys(cls(_params()))) == want, cls.__name__
    assert _policy(optimizer_keys(bnb.optim.AdamW(_params(), optim_bits=8))) == ("adamw", "8bit")
    with pytest.raises(zo.ConfigError, match="min_8bit_size"):
        optimizer_keys(bnb.optim.AdamW8bit(_params(), min_8bit_size=100))
    with pytest.raises(zo.ConfigError, match="bitsandbytes.Lion8bit"):
        optimizer_keys(bnb.optim.SGD(_params(), lr=0.1, momentum=0.9))
    module = nn.Linear(4, 4)
    hyper = hyperparameters(bnb.optim.Lion(module.parameters(), lr=3e-4, weight_decay=0.5), module)
    assert hyper["optimizer_type"] == "lion" and hyper["lr"] == 3e-4
    assert hyper["betas"] == (0.9, 0.99) and hyper["weight_decay"] == 0.5


def test_torchao_class():
    optim = pytest.importorskip("torchao.optim", reason="torchao not installed (dev extra)")
    assert _policy(optimizer_keys(optim.AdamW8bit(_params()))) == ("adamw", "8bit")


@pytest.fixture
def leaves_no_process_group():
    """The trainers run in this process: Lightning (and HF's accelerate) initialize a process
    group and set MASTER_ADDR / MASTER_PORT, which the tests after this one in the same pytest
    worker would inherit (a rehearsal refuses an initialized group; ranks a later test spawns
    would find the port taken). Put both back."""
    env = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


# -- two steps end to end ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "optim",
    [
        "lion_32bit",
        "adamw_torch_8bit",
        "adamw_torch",
    ],
)
def test_hf_trainer_trains_two_steps(tmp_path, optim, leaves_no_process_group):
    pytest.importorskip("transformers")
    from hf_trainer_worker import LR, arguments, dataset, make, params

    from zero_offload.integrations.hf import ZeroOffloadTrainer

    model = make("llama")
    before = params(model)
    trainer = ZeroOffloadTrainer(
        model=model,
        args=arguments(str(tmp_path), optim=optim, max_steps=2, gradient_accumulation_steps=1),
        train_dataset=dataset(),
        zero_offload=dict(stage=2, offload_optimizer="cpu"),
    )
    out = trainer.train()
    engine = trainer.engine
    want = HF_EXPECTED[optim]
    assert (
        engine.config.optimizer.policy.kind.value,
        engine.config.optimizer.moment_precision,
    ) == want
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    after = engine.full_state_dict()
    engine.close()
    moved = max((after[k].float() - before[k]).abs().max().item() for k in before) / LR
    assert moved >= 1.0, "two steps must move the weights by about the lr"


@pytest.mark.parametrize("optimizer", ["bnb.AdamW8bit", "torch.AdamW"])
def test_lightning_strategy_trains_two_steps(optimizer, leaves_no_process_group):
    L = pytest.importorskip("lightning")
    if optimizer == "bnb.AdamW8bit":
        bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed (dev extra)")
        make_optimizer, precision = bnb.optim.AdamW8bit, "8bit"
    else:
        make_optimizer, precision = torch.optim.AdamW, "fp32"
    from support.models import batch, loss_fn, make

    from zero_offload.integrations.lightning import ZeroOffloadStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = make("gpt")

        def training_step(self, data, index):
            x, y = data
            return loss_fn("gpt", self.net(x), y)

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), lr=1e-2, weight_decay=0.1)

    gen = torch.Generator().manual_seed(0)
    data = [batch("gpt", 2, gen) for _ in range(4)]
    lit = Lit()
    before = {k: v.detach().clone() for k, v in lit.state_dict().items()}
    strategy = ZeroOffloadStrategy(stage=2, offload_optimizer="cpu")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=None))
    engine = strategy.engine
    assert engine.config.optimizer.moment_precision == precision
    assert trainer.global_step == 2
    after = engine.full_state_dict()
    engine.close()
    assert after.keys() == before.keys()
    moved = max((after[k].float() - before[k].float()).abs().max().item() for k in before)
    assert moved >= 1e-2, "two steps must move the weights by about the lr"


def test_bnb_8bit_optims_keep_embeddings_in_fp32_as_trainer_does(tmp_path):
    """Trainer gives bitsandbytes' 8-bit optimizers a 32-bit override for every nn.Embedding
    (rows a batch does not use would take an m / eps jump with 8-bit v); torchao's AdamW8bit
    gets none. The engine keeps those weights' moments in fp32 in the same cases, so
    ZeroOffloadTrainer ends where plain Trainer with bitsandbytes ends."""
    pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    from hf_trainer_worker import LR, arguments, dataset, make, params
    from transformers import Trainer

    from zero_offload.integrations.hf import ZeroOffloadTrainer, engine_keywords

    embedding = "model.embed_tokens.weight"
    for optim in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit"):
        kw = engine_keywords(arguments("unused", optim=optim), make("llama"), dict(stage=2))
        assert kw["fp32_moment_params"] == [embedding], optim
    for optim in ("adamw_torch_8bit", "lion_32bit", "adamw_torch"):
        kw = engine_keywords(arguments("unused", optim=optim), make("llama"), dict(stage=2))
        assert "fp32_moment_params" not in kw, optim

    args = dict(optim="adamw_bnb_8bit", gradient_accumulation_steps=1)
    model = make("llama")
    before = params(model)
    Trainer(
        model=model, args=arguments(str(tmp_path / "a"), **args), train_dataset=dataset()
    ).train()
    plain = params(model)
    trainer = ZeroOffloadTrainer(
        model=make("llama"),
        args=arguments(str(tmp_path / "b"), **args),
        train_dataset=dataset(),
        zero_offload=dict(stage=2, offload_optimizer="cpu"),
    )
    trainer.train()
    ours = trainer.engine.full_state_dict()
    assert trainer.engine.state_policy.fp32_moments == {embedding}
    trainer.engine.close()
    # 8-bit moments quantized: unused rows moved 13.3 lr (plain: 1.8), 12 lr from plain's
    moved, ours_moved, gap = (
        (a - b).abs().max().item() / LR
        for a, b in [
            (plain[embedding], before[embedding]),
            (ours[embedding].float(), before[embedding]),
            (ours[embedding].float(), plain[embedding]),
        ]
    )
    assert ours_moved <= 1.5 * moved and gap <= 2.0, (moved, ours_moved, gap)


def test_hf_optim_args_are_honoured_or_refused():
    """``TrainingArguments.optim_args`` as Trainer reads it for the optims we map: Adagrad's
    eps and weight_decay, torchao's bf16_stochastic_round (a bf16 master rounded
    stochastically); what the engine cannot do is a ConfigError, never silently dropped."""
    pytest.importorskip("transformers")
    from hf_trainer_worker import arguments, make

    from zero_offload.integrations.hf import engine_keywords

    def keywords(optim, optim_args):
        args = arguments("unused", optim=optim, optim_args=optim_args)
        return engine_keywords(args, make("llama"), dict(stage=2))

    kw = keywords("adagrad", "lr_decay=0, eps=1e-6, weight_decay=0.01")
    assert kw["eps"] == 1e-6 and kw["weight_decay"] == 0.01
    assert keywords("adamw_torch_8bit", "bf16_stochastic_round=True")["master_precision"] == (
        "bf16_sr"
    )
    assert "master_precision" not in keywords("adamw_torch_8bit", "block_size=256")
    for optim, optim_args, match in [
        ("adagrad", "lr_decay=0.1", "lr_decay"),
        ("adamw_torch_8bit", "block_size=128", "block_size"),
        ("adamw_torch", "foo=1", "foo"),
        ("lion_8bit", "eps=1e-6", "eps"),
    ]:
        with pytest.raises(zo.ConfigError, match=f"optim_args.*{match}"):
            keywords(optim, optim_args)
