"""A Trainer run's ``initialize`` keywords and lr schedule from ``TrainingArguments`` and the
user's config, a DeepSpeed one read as Hugging Face's DeepSpeed integration reads it."""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch
import torch.nn as nn

from ..config import ConfigError, load_config
from ..deepspeed_config import is_deepspeed, lr_scheduler, translate
from .optimizers import hf_optim_keys

log = logging.getLogger(__name__)


def _auto_values(args: Any, model: nn.Module) -> dict[str, Any]:
    """What Hugging Face's DeepSpeed integration fills ``"auto"`` keys with."""
    world = max(1, args.world_size)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    out: dict[str, Any] = {
        "fp16.enabled": bool(args.fp16 or args.fp16_full_eval),
        "bf16.enabled": bool(args.bf16 or args.bf16_full_eval),
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "train_batch_size": args.per_device_train_batch_size
        * world
        * args.gradient_accumulation_steps,
    }
    if hidden:
        out["zero_optimization.reduce_bucket_size"] = hidden * hidden
        out["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        out["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden
    return out


# keys Hugging Face's integration requires to agree with TrainingArguments unless "auto"
_MUST_MATCH = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "fp16.enabled",
    "bf16.enabled",
)


def _dig(data: Mapping[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def _check_matches(config: Mapping[str, Any], auto: Mapping[str, Any]) -> None:
    """Like Hugging Face's DeepSpeed integration: a value given (not "auto") must agree with
    TrainingArguments, where a disagreement would leave one of them silently unused."""
    bad = []
    for key in _MUST_MATCH:
        value = _dig(config, key)
        want = auto[key]
        if value is None or value == "auto":
            continue
        same = list(value) == list(want) if isinstance(want, list) else value == want
        if not same:
            bad.append(f"{key}={value!r} but TrainingArguments give {want!r}")
    if bad:
        raise ConfigError(
            "DeepSpeed config values disagree with TrainingArguments: "
            + "; ".join(bad)
            + '. Set them to "auto" (or make TrainingArguments agree)'
        )


def _optim_args(optim: str, text: str | None) -> dict[str, Any]:
    """``TrainingArguments.optim_args`` ("k=v,k=v") as the engine's keywords, for the keys
    Trainer reads for ``optim`` that the engine does too; any other is a ConfigError (Trainer
    would have passed it to its optimizer: dropping it would change the run unnoticed)."""
    given = dict(p.split("=", 1) for p in (text or "").replace(" ", "").split(",") if "=" in p)
    kw: dict[str, Any] = {}
    for key, value in given.items():
        if optim == "adagrad" and key in ("eps", "weight_decay"):
            kw[key] = _float(key, value)
        elif optim == "adagrad" and key == "lr_decay" and _float(key, value) == 0.0:
            pass
        elif optim == "adamw_torch_8bit" and key == "block_size" and _float(key, value) == 256:
            pass  # the engine's blocks are 256 elements
        elif optim == "adamw_torch_8bit" and key == "bf16_stochastic_round":
            if value.lower() in ("true", "1", "yes"):
                kw["master_precision"] = "bf16_sr"  # bf16 weights, rounded stochastically
        else:
            raise ConfigError(
                f"TrainingArguments.optim_args {key}={value} with optim={optim!r} is not "
                "honoured by zero_offload (it takes Adagrad's eps, weight_decay and "
                "lr_decay=0, torchao's block_size=256 and bf16_stochastic_round); remove it, "
                "or set the engine keyword it stands for in the zero_offload config"
            )
    return kw


def _float(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(
            f"TrainingArguments.optim_args {key}={value}: expected a number"
        ) from None


BNB_8BIT_OPTIMS = frozenset(
    {"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "paged_lion_8bit"}
)
"""The optims for which Trainer keeps every ``nn.Embedding``'s state in 32 bits (its
bitsandbytes override); torchao's ``adamw_torch_8bit`` gets none."""


def engine_keywords(
    args: Any,
    model: nn.Module,
    zero_offload: Mapping[str, Any] | str | os.PathLike | None,
    decay_names: list[str] | None = None,
) -> dict[str, Any]:
    """``initialize`` keywords for a Trainer run: TrainingArguments first, then the user's.
    ``decay_names``: the parameters Trainer decays (``get_decay_parameter_names``); the other
    trainable ones go to ``no_decay``, as in Trainer's own no-decay group. A DeepSpeed config
    is read as Hugging Face's DeepSpeed integration reads it: "auto" filled from
    TrainingArguments, other values required to agree with them, and its ``optimizer``
    (if any) decaying every parameter, as DeepSpeed's optimizer does."""
    optim = getattr(args.optim, "value", args.optim)
    user = load_config(zero_offload)
    deepspeed = is_deepspeed(user)
    kind = {} if deepspeed and "optimizer" in user else hf_optim_keys(optim)
    kw: dict[str, Any] = dict(
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
        **kind,
    )
    if kind.get("optimizer_type") == "adagrad":  # Trainer passes only lr to torch's Adagrad
        del kw["betas"], kw["eps"]
    if not (deepspeed and "optimizer" in user):
        kw.update(_optim_args(optim, args.optim_args))
    if optim in BNB_8BIT_OPTIMS and kind:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        kept = [n for n, p in model.named_parameters() if id(p) in embeddings and p.requires_grad]
        if kept:
            kw["fp32_moment_params"] = kept
    if decay_names is not None and not (deepspeed and "optimizer" in user):
        decayed = set(decay_names)
        no_decay = [n for n, p in model.named_parameters() if p.requires_grad and n not in decayed]
        if no_decay:
            kw["no_decay"] = no_decay
    if args.bf16 or args.fp16:
        kw["dtype"] = torch.bfloat16 if args.bf16 else torch.float16
    if deepspeed:
        auto = _auto_values(args, model)
        _check_matches(user, auto)
        user = translate(user, auto, trainer="ZeroOffloadTrainer", world=max(1, args.world_size))
    kw.update(user)
    gas = kw.pop("gradient_accumulation_steps", args.gradient_accumulation_steps)
    if gas != args.gradient_accumulation_steps:
        raise ConfigError(
            f"gradient_accumulation_steps={gas} in the zero_offload config but "
            f"{args.gradient_accumulation_steps} in TrainingArguments: Trainer counts the "
            "micro-batches, so set it in TrainingArguments only"
        )
    return kw


def deepspeed_schedule(
    args: Any,
    zero_offload: Mapping[str, Any] | str | os.PathLike | None,
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The ``scheduler`` of a DeepSpeed config, with its "auto" values filled as Hugging
    Face's integration fills them (None without one: Trainer's own schedule runs)."""
    config = load_config(zero_offload)
    if not is_deepspeed(config) or "scheduler" not in config:
        return None
    warmup = max(1, args.get_warmup_steps(num_training_steps))
    auto = {
        "warmup_min_lr": 0,
        "warmup_max_lr": args.learning_rate,
        "warmup_num_steps": warmup,
        "total_num_steps": num_training_steps,
    }
    params = (config["scheduler"] or {}).get("params") or {}
    bad = [
        f"scheduler.params.{k}={params[k]!r} but TrainingArguments give {v!r}"
        for k, v in auto.items()
        if k != "warmup_min_lr" and params.get(k, "auto") != "auto" and params[k] != v
    ]
    if bad:
        raise ConfigError(
            "DeepSpeed config values disagree with TrainingArguments: "
            + "; ".join(bad)
            + '. Set them to "auto" (or make TrainingArguments agree)'
        )
    log.info(
        "DeepSpeed config: its %s schedule drives the learning rate (not lr_scheduler_type)",
        config["scheduler"].get("type"),
    )
    return lr_scheduler(optimizer, config, auto)
