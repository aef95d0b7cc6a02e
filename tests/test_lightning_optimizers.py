"""What ``configure_optimizers`` returns, under ZeroOffloadStrategy, in this process on a tiny
model: results compared with plain Lightning (``strategy="auto"``) where the engine runs the
optimizer (bitsandbytes Lion; SequentialLR and ChainedScheduler, whose child schedulers must
drive the engine's lr too; a frozen body), and a ConfigError naming the fix where it cannot
(an optimizer over only some trainable parameters; ``maximize``, ``amsgrad``)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import zero_offload as zo

L = pytest.importorskip("lightning")

import zero_offload.integrations.lightning  # noqa: E402  (registers the strategy names)
from zero_offload.integrations.lightning_optimizers import hyperparameters  # noqa: E402
from zero_offload.integrations.optimizers import optimizer_keys  # noqa: E402

warnings.filterwarnings("ignore")
LR = 1e-2


@pytest.fixture(autouse=True)
def leaves_no_process_group():
    """The strategy initializes a process group and sets MASTER_ADDR / MASTER_PORT, which
    later tests in the same pytest worker would inherit: put both back."""
    env = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


class Lit(L.LightningModule):
    """``body`` then ``head``; ``make(module)`` returns what configure_optimizers returns.
    Records the lr of each training step."""

    def __init__(self, make) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 1)
        self.make = make
        self.lrs: list[float] = []

    def training_step(self, data, index):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        x, y = data
        return torch.nn.functional.mse_loss(self.head(torch.relu(self.body(x))), y)

    def configure_optimizers(self):
        return self.make(self)


def fit(strategy: str, make, freeze_body: bool = False):
    """Trains 8 steps; returns the final weights and the lr of each step."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    module = Lit(make)
    if freeze_body:
        module.body.requires_grad_(False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    engine = getattr(trainer.strategy, "engine", None)
    if engine is None:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}, module.lrs
    weights = engine.full_state_dict()
    engine.close()
    return weights, module.lrs


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- bitsandbytes Lion: no eps -----------------------------------------------------------------

LIONS = ["Lion", "Lion32bit", "PagedLion", "PagedLion32bit", "Lion8bit", "PagedLion8bit"]


@pytest.mark.parametrize("name", LIONS)
def test_bitsandbytes_lion_passes_no_eps(name):
    """bitsandbytes' Lion keeps ``eps=0.0`` in its groups; Lion has no eps, so none goes to
    the engine (whose eps must be > 0)."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed (dev extra)")
    module = torch.nn.Linear(4, 4)
    hyper = hyperparameters(getattr(bnb.optim, name)(module.parameters(), lr=3e-4), module)
    assert "eps" not in hyper and hyper["optimizer_type"] == "lion"
    zo.config.OptimizerConfig(**hyper)  # valid engine keywords


def test_bitsandbytes_lion_matches_plain_lightning():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed (dev extra)")

    def make(m):
        return bnb.optim.Lion(m.parameters(), lr=LR, weight_decay=0.1)

    plain, _ = fit("auto", make)
    ours, _ = fit("zero_offload", make)
    assert max_diff(plain, ours) / LR <= 0.03


# -- schedulers with child schedulers ----------------------------------------------------------


def _two_groups(m) -> torch.optim.AdamW:
    """Weights decayed, biases not: the schedulers keep one entry per group."""
    named = list(m.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
        ],
        lr=LR,
        weight_decay=0.1,
    )


def _sequential(opt):
    sched = torch.optim.lr_scheduler
    warm = sched.LinearLR(opt, start_factor=0.1, total_iters=3)
    return sched.SequentialLR(opt, [warm, sched.CosineAnnealingLR(opt, T_max=5)], [3])


def _chained(opt):
    sched = torch.optim.lr_scheduler
    return sched.ChainedScheduler(
        [sched.LambdaLR(opt, lambda s: 1 / (1 + s)), sched.ExponentialLR(opt, gamma=0.8)]
    )


def _nested(opt):
    sched = torch.optim.lr_scheduler
    warm = sched.LinearLR(opt, start_factor=0.2, total_iters=2)
    inner = sched.SequentialLR(opt, [warm, sched.ConstantLR(opt, 0.5, total_iters=3)], [2])
    return sched.ChainedScheduler([inner, sched.ExponentialLR(opt, gamma=0.9)])


@pytest.mark.parametrize("schedule", [_sequential, _chained, _nested], ids=lambda f: f.__name__)
def test_schedulers_of_schedulers_drive_the_engines_lr(schedule):
    """SequentialLR and ChainedScheduler step their children, built on the user's optimizer:
    those must move the engine's lr, step by step as in plain Lightning."""

    def make(m):
        opt = _two_groups(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}

    plain, plain_lrs = fit("auto", make)
    ours, lrs = fit("zero_offload", make)
    assert len(set(plain_lrs)) > 4  # the schedule moves the lr
    assert lrs == pytest.approx(plain_lrs, rel=1e-12)
    assert max_diff(plain, ours) / LR <= 0.03


# -- an optimizer over some of the trainable parameters ----------------------------------------


def test_optimizer_over_some_trainable_parameters_is_refused():
    """Plain Lightning leaves the parameters outside the optimizer unchanged; the engine steps
    every trainable parameter, so it asks for them to be frozen."""
    with pytest.raises(zo.ConfigError, match=r"requires_grad_\(False\)") as err:
        fit("zero_offload", lambda m: torch.optim.AdamW(m.head.parameters(), lr=LR))
    assert "body.weight" in str(err.value) and "body.bias" in str(err.value)


def test_frozen_body_with_an_optimizer_over_the_head_matches_plain_lightning():
    """The fix the error names: freeze what the optimizer leaves out."""

    def make(m):
        return torch.optim.AdamW(m.head.parameters(), lr=LR)

    plain, _ = fit("auto", make, freeze_body=True)
    ours, _ = fit("zero_offload", make, freeze_body=True)
    assert (ours["body.weight"] == Lit(make).body.weight).all()
    assert max_diff(plain, ours) / LR <= 0.03


# -- flags the engine's update does not have ---------------------------------------------------


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(8))]


FLAGS = [
    (torch.optim.AdamW, "maximize"),
    (torch.optim.AdamW, "amsgrad"),
    (torch.optim.Adam, "maximize"),
    (torch.optim.Adam, "amsgrad"),
    (torch.optim.Adagrad, "maximize"),
]


@pytest.mark.parametrize(("cls", "flag"), FLAGS, ids=[f"{c.__name__}-{f}" for c, f in FLAGS])
def test_maximize_and_amsgrad_are_refused(cls, flag):
    with pytest.raises(zo.ConfigError, match=rf"{cls.__name__}\({flag}=True\)"):
        optimizer_keys(cls(_params(), **{flag: True}))


def test_torchao_amsgrad_is_refused():
    optim = pytest.importorskip("torchao.optim", reason="torchao not installed (dev extra)")
    with pytest.raises(zo.ConfigError, match=r"AdamW8bit\(amsgrad=True\)"):
        optimizer_keys(optim.AdamW8bit(_params(), amsgrad=True))


def test_maximize_is_refused_at_fit():
    with pytest.raises(zo.ConfigError, match=r"maximize=True"):
        fit("zero_offload", lambda m: torch.optim.AdamW(m.parameters(), lr=LR, maximize=True))


def test_adam_with_decoupled_weight_decay_is_adamw():
    """``Adam(decoupled_weight_decay=True)`` is torch's AdamW update, not L2."""
    adam = torch.optim.Adam(_params(), weight_decay=0.1, decoupled_weight_decay=True)
    assert optimizer_keys(adam) == {}
