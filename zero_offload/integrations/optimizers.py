"""The optimizers the trainer integrations accept, as the engine's optimizer keywords.

Hugging Face Trainer names its optimizer (``TrainingArguments.optim``); Lightning's
``configure_optimizers`` returns one (torch's, bitsandbytes', torchao's). Either way the
engine runs the same update in its own kernel, with the state precision the name or class
says (``optimizer_type``, ``moment_precision``; the master stays fp32, as theirs does). One
table per integration, here, so both accept the same set and say the same when they refuse.

bitsandbytes' ``Adam`` classes decay weights as ``p *= 1 - lr * wd`` (as its ``AdamW``), so
they map to ``adamw``; paged variants page GPU memory, which the engine's host-resident state
does not need, so they map to their unpaged update.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["HF_OPTIMS", "OPTIMIZER_CLASSES", "POLICY_KEYS", "hf_optim_keys", "optimizer_keys"]

POLICY_KEYS = ("optimizer_type", "moment_precision")
_ADAMW: dict[str, str] = {}  # the defaults: fp32 AdamW
_ADAMW_8BIT = {"moment_precision": "8bit"}
_LION = {"optimizer_type": "lion"}
_LION_8BIT = {"optimizer_type": "lion", "moment_precision": "8bit"}
_ADAGRAD = {"optimizer_type": "adagrad"}

HF_OPTIMS: dict[str, dict[str, str]] = {
    "adamw_torch": _ADAMW,
    "adamw_torch_fused": _ADAMW,
    "adamw_hf": _ADAMW,
    "paged_adamw_32bit": _ADAMW,
    "adamw_torch_8bit": _ADAMW_8BIT,  # torchao's AdamW8bit
    "adamw_bnb_8bit": _ADAMW_8BIT,  # bitsandbytes' AdamW8bit
    "adamw_8bit": _ADAMW_8BIT,
    "paged_adamw_8bit": _ADAMW_8BIT,
    "lion_32bit": _LION,
    "paged_lion_32bit": _LION,
    "lion_8bit": _LION_8BIT,
    "paged_lion_8bit": _LION_8BIT,
    "adagrad": _ADAGRAD,
}
"""``TrainingArguments.optim`` -> the engine's keywords (Hugging Face's ``OptimizerNames``)."""

_BNB_32 = ("AdamW", "AdamW32bit", "PagedAdamW", "PagedAdamW32bit", "Adam", "Adam32bit")
_BNB_8 = ("AdamW8bit", "PagedAdamW8bit", "Adam8bit", "PagedAdam8bit")
OPTIMIZER_CLASSES: dict[tuple[str, str], dict[str, str]] = {
    ("torch", "AdamW"): _ADAMW,
    ("torch", "Adam"): _ADAMW,  # weight decay 0 only (else L2: optimizer_type "adam")
    ("torch", "Adagrad"): _ADAGRAD,
    **{("bitsandbytes", name): _ADAMW for name in (*_BNB_32, "PagedAdam", "PagedAdam32bit")},
    **{("bitsandbytes", name): _ADAMW_8BIT for name in _BNB_8},
    **{("bitsandbytes", n): _LION for n in ("Lion", "Lion32bit", "PagedLion", "PagedLion32bit")},
    **{("bitsandbytes", name): _LION_8BIT for name in ("Lion8bit", "PagedLion8bit")},
    **{("bitsandbytes", name): _ADAGRAD for name in ("Adagrad", "Adagrad32bit")},
    ("torchao", "AdamW8bit"): _ADAMW_8BIT,
}
"""(top-level package, class name) -> the engine's keywords, for Lightning's optimizers."""
_BNB_BITS = {"AdamW", "Adam", "PagedAdamW", "PagedAdam", "Lion", "PagedLion"}  # optim_bits=


# Flags of torch's (and torchao's) optimizers that change the update the engine runs; none of
# Hugging Face's ``optim`` names sets them.
_NO_FLAGS = {
    "maximize": "leave it False and negate the loss instead",
    "amsgrad": "leave it False",
}


def hf_optim_keys(optim: str) -> dict[str, str]:
    """The engine's keywords for ``TrainingArguments.optim`` (a ConfigError lists the
    names accepted)."""
    keys = HF_OPTIMS.get(optim)
    if keys is None:
        raise ConfigError(
            f"TrainingArguments.optim={optim!r} is not supported by zero_offload; use one of "
            + ", ".join(repr(n) for n in HF_OPTIMS)
        )
    return dict(keys)


def _supported_classes() -> str:
    return ", ".join(f"{pkg}.{name}" for pkg, name in OPTIMIZER_CLASSES)


def optimizer_keys(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """The engine's keywords for the optimizer ``configure_optimizers`` returned (or a
    subclass of one of them; a ConfigError lists the classes accepted)."""
    for cls in type(optimizer).__mro__:
        key = (cls.__module__.partition(".")[0], cls.__name__)
        if key in OPTIMIZER_CLASSES:
            break
    else:
        raise ConfigError(
            f"configure_optimizers returned {type(optimizer).__name__}: zero_offload runs "
            f"AdamW, Adam, Lion and Adagrad; return one of {_supported_classes()}"
        )
    keys = dict(OPTIMIZER_CLASSES[key])
    groups = optimizer.param_groups
    for flag, fix in _NO_FLAGS.items():
        if any(g.get(flag) for g in groups):
            raise ConfigError(
                f"{type(optimizer).__name__}({flag}=True): zero_offload's update has no "
                f"{flag}; {fix}"
            )
    decoupled = any(g.get("decoupled_weight_decay") for g in groups)  # torch's Adam: AdamW
    if key == ("torch", "Adam") and any(g["weight_decay"] for g in groups) and not decoupled:
        keys["optimizer_type"] = "adam"  # weight decay added to the gradient, as torch's
    if key[0] == "bitsandbytes":
        args: Any = optimizer.args  # type: ignore[attr-defined]  # bitsandbytes' Optimizer8bit
        if key[1] in _BNB_BITS and args.optim_bits == 8:
            keys["moment_precision"] = "8bit"
        if keys.get("moment_precision") == "8bit" and args.min_8bit_size != 4096:
            raise ConfigError(
                f"{key[1]}(min_8bit_size={args.min_8bit_size}): zero_offload quantizes "
                "parameters of 4096 elements or more (bitsandbytes' default); leave "
                "min_8bit_size at 4096"
            )
    if keys.get("optimizer_type") == "adagrad":
        for name in ("lr_decay", "initial_accumulator_value"):
            if any(g.get(name, 0) for g in groups):
                raise ConfigError(
                    f"{type(optimizer).__name__}({name}=...): zero_offload's Adagrad has "
                    f"no {name}; leave it at 0"
                )
    return keys
