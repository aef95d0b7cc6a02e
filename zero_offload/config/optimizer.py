"""The optimizer's section: its kind and state precisions, hyperparameters, clipping."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..fields import keyword
from ..optim.policy import StatePolicy
from .checks import bad, number, whole_numbers

__all__ = ["OptimizerConfig", "POLICY_FIELDS"]

POLICY_FIELDS = {
    "optimizer_type": "kind",
    "moment_precision": "moments",
    "master_precision": "master",
}


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer: its kind and state precisions (:class:`~.optim.policy.StatePolicy`),
    hyperparameters (same meaning as the matching torch optimizer) and gradient clipping."""

    optimizer_type: str = keyword(
        "adamw",
        'the update rule: "adamw", "adam" (L2 weight decay added to the gradient, as '
        '`torch.optim.Adam`), "lion" (one momentum, sign update), "adagrad". Any choice but '
        'the default three is stepped by the CPU kernel: `offload_optimizer="cpu"`, or no '
        "offload on a CPU device (not yet on NVMe); see [optimizer_states.md](optimizer_states.md)",
    )
    moment_precision: str = keyword(
        "fp32",
        'Adam\'s m and v, Lion\'s momentum: "fp32", "bf16" (stochastically rounded), "8bit" '
        "(blockwise, bitsandbytes' maps; tensors under 4096 elements stay fp32)",
    )
    master_precision: str = keyword(
        "fp32",
        'the optimizer\'s copy of the parameters: "fp32", "bf16_kahan" (bf16 + a bf16 '
        'compensation term), "bf16_sr" (bf16, stochastic rounding)',
    )
    fp32_moment_params: tuple[str, ...] = keyword(
        (),
        'names of parameters whose moments stay fp32 under moment_precision="8bit" '
        "(bitsandbytes' per-parameter 32-bit override; `ZeroOffloadTrainer` names every "
        "`nn.Embedding` weight for the bitsandbytes 8-bit optims, as Trainer does); an unknown "
        "name is a `ConfigError`",
    )
    lr: float = keyword(1e-3, "the learning rate, as the matching torch optimizer's")
    betas: tuple[float, float] | None = keyword(
        None,
        "as the matching torch optimizer's; None: the kind's default, (0.9, 0.999) for Adam(W), "
        "(0.9, 0.99) for Lion (its paper's)",
    )
    eps: float | None = keyword(
        None, "None: 1e-8 for Adam(W), 1e-10 for Adagrad (as torch); Lion has none"
    )
    weight_decay: float = keyword(
        1e-2,
        "decoupled for AdamW and Lion (`p *= 1 - lr * wd`), added to the gradient for Adam and "
        "Adagrad (as torch)",
    )
    max_grad_norm: float | None = keyword(
        None,
        "clip by the global norm over all shards (= `clip_grad_norm_` on the full model); "
        "None: no clipping; inf: no clipping, the norm still measured (`engine.last_grad_norm`)",
    )
    no_decay: tuple[str, ...] = keyword(
        (),
        "names (as in `model.named_parameters()`) of parameters stepped without weight decay: "
        "biases and norm weights, the no-decay group of Hugging Face Trainer; an unknown name "
        "is a `ConfigError`",
    )

    def __post_init__(self) -> None:
        whole_numbers(self)
        policy = self.policy  # validates the three keys
        for key in ("optimizer_type", "moment_precision", "master_precision"):
            object.__setattr__(self, key, getattr(policy, POLICY_FIELDS[key]).value)
        if self.betas is None:
            object.__setattr__(self, "betas", policy.kind.default_betas)
        if self.eps is None:
            object.__setattr__(self, "eps", policy.kind.default_eps)
        number("lr", self.lr, lo=0.0)
        for key, example in (
            ("no_decay", "['fc.bias', 'norm.weight']"),
            ("fp32_moment_params", "['model.embed_tokens.weight']"),
        ):
            names = getattr(self, key)
            if not isinstance(names, (list, tuple, set, frozenset)) or not all(
                isinstance(n, str) for n in names
            ):
                raise bad(key, names, f"expected a list of parameter names, e.g. {example}")
            object.__setattr__(self, key, tuple(names))
        if (
            not isinstance(self.betas, (tuple, list))
            or len(self.betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas)
        ):
            raise bad("betas", self.betas, "expected two numbers in [0, 1), e.g. (0.9, 0.999)")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        number("eps", self.eps, lo=0.0, lo_open=True)
        number("weight_decay", self.weight_decay, lo=0.0)
        if self.max_grad_norm is not None:
            number("max_grad_norm", self.max_grad_norm, lo=0.0, lo_open=True, inf_ok=True)

    @property
    def policy(self) -> StatePolicy:
        """The optimizer kind and state precisions as one type (decided here, once)."""
        try:
            return StatePolicy.parse(
                self.optimizer_type,
                self.moment_precision,
                self.master_precision,
                self.fp32_moment_params,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def adam_betas(self) -> tuple[float, float]:
        """``betas`` as resolved (never None once built)."""
        assert self.betas is not None
        return self.betas
