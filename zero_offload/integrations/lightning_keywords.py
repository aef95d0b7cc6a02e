"""The Lightning strategy's engine keywords: from the Trainer (precision, clipping,
accumulation) and ``configure_optimizers``, then the strategy's config (a DeepSpeed config read
as Lightning's ``DeepSpeedStrategy`` reads it), then its keywords, which win."""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch

from ..config import ConfigError, load_config
from ..deepspeed_config import SCHEDULES, is_deepspeed, lr_scheduler, translate
from ..policies import Stage

__all__ = ["NVME_ENV", "StrategyConfig", "config_schedule"]

log = logging.getLogger(__name__)

NVME_ENV = "ZERO_OFFLOAD_NVME_PATH"  # nvme_path for the registered "..._nvme" names


class StrategyConfig:
    """What the strategy was given: ``config`` (a dict or JSON file of ``initialize``
    keywords, or a DeepSpeed config) and ``keywords``, which win over it."""

    def __init__(
        self, config: Mapping[str, Any] | str | os.PathLike | None, keywords: dict[str, Any]
    ) -> None:
        if keywords.get("nvme_path") == NVME_ENV:  # a registered name: the path comes from env
            keywords["nvme_path"] = os.environ.get(NVME_ENV)
            if not keywords["nvme_path"]:
                raise ConfigError(
                    f"this strategy keeps state on NVMe: set {NVME_ENV}="
                    "/path/on/a/fast/disk, or pass ZeroOffloadStrategy("
                    "nvme_path=...)"
                )
        self.config = config
        self.keywords = keywords

    def deepspeed(self) -> dict[str, Any] | None:
        """The config when it is a DeepSpeed one."""
        user = load_config(self.config)
        return user if is_deepspeed(user) else None

    def stage(self) -> int:
        if "stage" in self.keywords:
            return int(self.keywords["stage"])
        user = load_config(self.config)
        if not is_deepspeed(user):
            return int(user.get("stage", 0))
        zero = user.get("zero_optimization", {})
        stage = zero.get("stage", 0) if isinstance(zero, Mapping) else int(bool(zero))
        return 0 if stage == "auto" else int(stage)

    def shards_params(self) -> bool:
        """Whether the configured stage shards the parameters, read before the config is
        built (an invalid stage is named by the config's check, later)."""
        try:
            return Stage(self.stage()).shards_params
        except ValueError:
            return False

    def engine_keywords(self, trainer: Any, hyper: dict[str, Any], world: int) -> dict[str, Any]:
        """Keywords from the Trainer and ``configure_optimizers`` (``hyper``), then the
        config (a DeepSpeed one read as Lightning's DeepSpeedStrategy reads it: an absent
        ``gradient_clipping`` is ``gradient_clip_val``), then the keywords."""
        kw = dict(hyper)
        if trainer.gradient_clip_val:
            if trainer.gradient_clip_algorithm not in (None, "norm"):
                raise ConfigError(
                    f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}:"
                    " zero_offload clips by the global norm; use 'norm'"
                )
            kw["max_grad_norm"] = float(trainer.gradient_clip_val)
        precision = str(trainer.precision)
        if precision == "bf16-mixed":  # autocast runs the bf16 parameters on fp32 inputs
            kw["dtype"] = torch.bfloat16
        elif precision not in ("32-true", "32"):
            raise ConfigError(
                f"precision={precision!r}: use '32-true' or 'bf16-mixed' with ZeroOffloadStrategy"
            )
        user = load_config(self.config)
        if is_deepspeed(user):
            user = translate(
                user,
                _auto_values(trainer, hyper),
                trainer="ZeroOffloadStrategy",
                defaults={"gradient_clipping": trainer.gradient_clip_val or 0.0},
                world=world,
            )
        kw.update(user)
        kw.update(self.keywords)
        gas = kw.pop("gradient_accumulation_steps", trainer.accumulate_grad_batches)
        if gas != trainer.accumulate_grad_batches:
            raise ConfigError(
                f"gradient_accumulation_steps={gas} in the zero_offload config "
                f"but accumulate_grad_batches={trainer.accumulate_grad_batches}: "
                "Lightning counts the micro-batches, so set it on the Trainer only"
            )
        return kw


def _auto_values(trainer: Any, hyper: Mapping[str, Any]) -> dict[str, Any]:
    """What the Lightning Trainer knows for a DeepSpeed config's "auto" values (batch sizes
    are the loaders': left unset)."""
    precision = str(trainer.precision)
    out: dict[str, Any] = {
        "fp16.enabled": precision.startswith("16"),
        "bf16.enabled": precision.startswith("bf16"),
        "gradient_accumulation_steps": trainer.accumulate_grad_batches,
        "gradient_clipping": trainer.gradient_clip_val or 0.0,
        "train_batch_size": None,
        "train_micro_batch_size_per_gpu": None,
    }
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key in hyper:
            out[f"optimizer.params.{key}"] = hyper[key]
    return out


def config_schedule(
    optimizer: torch.optim.Optimizer, config: Mapping[str, Any], lr: float, total_steps: int
) -> Any:
    """A DeepSpeed config's ``scheduler`` over ``optimizer``, its "auto" values from the
    engine's ``lr`` and the Trainer's ``total_steps`` (Lightning has no warmup: a warmup's
    "auto" takes DeepSpeed's default)."""
    resolve: dict[str, Any] = {
        "warmup_min_lr": 0,
        "warmup_max_lr": lr,
        "total_num_steps": total_steps,
    }
    section = config["scheduler"]
    for name, default in SCHEDULES.get(section.get("type"), {}).items():
        auto = (section.get("params") or {}).get(name) == "auto"
        if auto and name not in resolve and default is not None:
            log.info('DeepSpeed config: scheduler.params.%s is "auto": %r', name, default)
            resolve[name] = default
    schedule = lr_scheduler(optimizer, config, resolve)
    log.info("DeepSpeed config: its %s schedule drives the learning rate", schedule.kind)
    return schedule
