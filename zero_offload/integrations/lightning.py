"""Lightning on zero_offload: a ``Strategy`` registered as ``"zero_offload"`` and friends.

    import zero_offload.integrations.lightning  # registers the strategy names
    trainer = lightning.Trainer(strategy="zero_offload_stage3_offload", ...)
    # or, with any initialize keyword:
    trainer = lightning.Trainer(strategy=ZeroOffloadStrategy(stage=3, offload_optimizer="nvme",
                                                             nvme_path="/mnt/nvme"))

The LightningModule's ``configure_optimizers`` returns an ordinary ``torch.optim.AdamW`` (and
lr schedulers); the strategy reads its hyperparameters, builds the engine over the module and
hands Lightning the engine as the optimizer, re-pointing the schedulers at its
``param_groups``. Lightning keeps counting micro-batches (``accumulate_grad_batches``) and
scaling the loss; the engine reduces each micro-batch and steps at the window's end, clipping
by ``gradient_clip_val`` over all shards. Checkpoints (``trainer.save_checkpoint``,
``ModelCheckpoint``, ``fit(ckpt_path=...)``) are folders: the engine checkpoint plus
``lightning.pt`` with Lightning's own state (loops, schedulers, callbacks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from ..config import ConfigError, _load
from ..ds_config import is_deepspeed, translate
from ..engine import Engine, initialize
from .common import EngineOptimizer
from .stats import step_stats

__all__ = ["ZeroOffloadStrategy"]

log = logging.getLogger(__name__)

LIGHTNING_STATE = "lightning.pt"  # Lightning's own checkpoint entries, beside the engine's
NVME_ENV = "ZERO_OFFLOAD_NVME_PATH"  # nvme_path for the registered "..._nvme" names


def _hyperparameters(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, Any]:
    """AdamW keywords from the optimizer ``configure_optimizers`` returned. Its groups may
    differ only in weight decay, one value and 0 (the usual no-decay group of biases and
    norm weights: ``no_decay``)."""
    adamw = isinstance(optimizer, torch.optim.AdamW)
    if not adamw and not (
        type(optimizer) is torch.optim.Adam
        and all(g["weight_decay"] == 0 for g in optimizer.param_groups)
    ):
        raise ConfigError(
            f"configure_optimizers returned {type(optimizer).__name__}: "
            "zero_offload runs AdamW; return torch.optim.AdamW(...)"
        )
    keys = ("lr", "betas", "eps")
    groups = optimizer.param_groups
    first = {k: groups[0][k] for k in keys}
    decays = {g["weight_decay"] for g in groups} - {0.0}
    if any({k: g[k] for k in keys} != first for g in groups[1:]) or len(decays) > 1:
        raise ConfigError(
            "configure_optimizers returned parameter groups with different "
            "hyperparameters; zero_offload trains one group, with weight decay "
            "0 allowed for some parameters: use one lr, betas, eps and "
            "weight_decay"
        )
    first["betas"] = tuple(first["betas"])
    first["weight_decay"] = decays.pop() if decays else 0.0
    if first["weight_decay"]:
        undecayed = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
        names = [n for n, p in module.named_parameters() if id(p) in undecayed]
        if names:
            first["no_decay"] = names
    return first


# Per-group lists torch's lr schedulers keep (one entry per parameter group of the optimizer
# they were built on).
_PER_GROUP = (
    "base_lrs",
    "_last_lr",
    "lr_lambdas",
    "min_lrs",
    "max_lrs",
    "base_momentums",
    "max_momentums",
)


def _retarget(scheduler: Any, user: torch.optim.Optimizer, engine: EngineOptimizer) -> None:
    """Point a scheduler built on the user's optimizer at the engine's one group: the keys it
    added to the user's groups (``initial_lr``, ``max_lr``, ...) are copied, and its
    per-group lists keep the first group's entry (the groups share their lr)."""
    group = engine.param_groups[0]
    for key, value in user.param_groups[0].items():
        if key != "params" and key not in group:
            group[key] = value
    n = len(user.param_groups)
    for attr in _PER_GROUP:
        value = getattr(scheduler, attr, None)
        if n > 1 and isinstance(value, list) and len(value) == n:
            setattr(scheduler, attr, value[:1])
    scheduler.optimizer = engine


class ZeroOffloadStrategy(DDPStrategy):
    """Trains the LightningModule through a zero_offload engine. ``config``: a dict or JSON file
    of ``initialize`` keywords, or a DeepSpeed config; ``**keywords`` win over it."""

    strategy_name = "zero_offload"

    def __init__(
        self,
        config: Mapping[str, Any] | str | os.PathLike | None = None,
        *,
        accelerator: Any = None,
        parallel_devices: Any = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
        )
        if keywords.get("nvme_path") == NVME_ENV:  # a registered name: the path comes from env
            keywords["nvme_path"] = os.environ.get(NVME_ENV)
            if not keywords["nvme_path"]:
                raise ConfigError(
                    f"this strategy keeps state on NVMe: set {NVME_ENV}="
                    "/path/on/a/fast/disk, or pass ZeroOffloadStrategy("
                    "nvme_path=...)"
                )
        self.zero_offload_config = config
        self.zero_offload_keywords = keywords
        self.engine: Engine | None = None
        self._final = False  # the backward running ends an accumulation window

    # -- building the engine ----------------------------------------------------------------
    def _user_keywords(self) -> dict[str, Any]:
        """The config (a DeepSpeed one translated), then the keywords."""
        user = _load(self.zero_offload_config)
        if is_deepspeed(user):
            user = translate(user, allow=("scheduler",))
        return {**user, **self.zero_offload_keywords}

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Around ``configure_model``: at stage 3 its modules are built on the meta device,
        and the engine materializes them one unit at a time, each straight into its shards
        (``reset_parameters``, or the ``init_weights`` file): no rank ever holds the whole
        model. Other stages build it as usual."""
        if self._user_keywords().get("stage", 0) == 3:
            with torch.device("meta"):
                yield
        else:
            yield

    def _keywords(self, trainer: Any) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        kw = _hyperparameters(self.optimizers[0], module)
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
        kw.update(self._user_keywords())
        gas = kw.pop("gradient_accumulation_steps", trainer.accumulate_grad_batches)
        if gas != trainer.accumulate_grad_batches:
            raise ConfigError(
                f"gradient_accumulation_steps={gas} in the zero_offload config "
                f"but accumulate_grad_batches={trainer.accumulate_grad_batches}: "
                "Lightning counts the micro-batches, so set it on the Trainer only"
            )
        return kw

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert self.accelerator is not None and self.model is not None and module is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.engine is None:
            self.setup_optimizers(trainer)  # configure_optimizers: the user's AdamW
            user_opt = self.optimizers[0] if len(self.optimizers) == 1 else None
            if user_opt is None:
                raise ConfigError("configure_optimizers must return exactly one optimizer")
            kw = self._keywords(trainer)
            self.engine = initialize(module, **kw)
            log.info(
                "ZeroOffloadStrategy: %s",
                {k: f"{len(v)} parameters" if k == "no_decay" else v for k, v in kw.items()},
            )
            engine_opt = EngineOptimizer(self.engine)
            for config in self.lr_scheduler_configs:
                _retarget(config.scheduler, user_opt, engine_opt)
            self.optimizers = [engine_opt]
        elif self.engine is not None:
            self.optimizers = [EngineOptimizer(self.engine)]
        self.setup_precision_plugin()

    # DDPStrategy's returns the DistributedDataParallel wrapper, which this one never builds
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]
        return model  # no DDP: the engine reduces gradients itself

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    # -- forward, backward, step ------------------------------------------------------------
    @contextlib.contextmanager
    def _forward(self) -> Iterator[None]:
        """Stage 3 gathers parameters around each module while the step function runs."""
        engine = self.engine
        if engine is None:
            yield
            return
        ctx = engine.gatherer.forward() if engine.gatherer else contextlib.nullcontext()
        with ctx, engine.clock.phase("forward"):
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward():
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward():
            return super().predict_step(*args, **kwargs)

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Lightning already divided the loss for accumulation; the engine only adds the fp16
        loss scale, and learns from ``optimizer_step`` whether this micro-batch ends the
        window (manual optimization: every backward does)."""
        module = self.lightning_module
        assert self.engine is not None and module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.engine.backward(closure_loss, final=self._final or not module.automatic_optimization)
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        module = model if isinstance(model, LightningModule) else self.lightning_module
        assert module is not None
        self._final = True
        try:
            result = closure()  # training_step and backward of the window's last micro-batch
        finally:
            self._final = False
        self.precision_plugin._after_closure(module, optimizer)  # hooks (clipping: a no-op)
        optimizer.step()
        self._log_stats(module.trainer)
        return result

    def _log_stats(self, trainer: Any) -> None:
        if not trainer.loggers or (trainer.global_step + 1) % trainer.log_every_n_steps:
            return
        stats = step_stats(self.engine)
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=trainer.global_step)

    # -- checkpoints ------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine checkpoint holds the parameters (fp32 masters)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "ZeroOffloadStrategy writes checkpoint folders itself: "
                "storage_options is not supported"
            )
        if self.engine is None:
            raise RuntimeError("ZeroOffloadStrategy saves checkpoints during or after fit")
        path = Path(self.broadcast(str(filepath)))
        self.engine.save_checkpoint(path)
        if self.is_global_zero:
            rest = {
                k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
            }
            torch.save(rest, path / LIGHTNING_STATE)
        self.barrier("zero_offload.save_checkpoint")

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not (path / LIGHTNING_STATE).is_file():
            raise ConfigError(
                f"ckpt_path={str(path)!r} is not a ZeroOffloadStrategy checkpoint "
                f"folder (no {LIGHTNING_STATE})"
            )
        if self.engine is None:
            raise RuntimeError("ZeroOffloadStrategy resumes training checkpoints in fit()")
        self.engine.load_checkpoint(path)
        return torch.load(path / LIGHTNING_STATE, weights_only=False)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded with the engine checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded with the engine checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        names: dict[str, dict[str, Any]] = {
            "zero_offload": {},
            "zero_offload_stage2": dict(stage=2),
            "zero_offload_stage2_offload": dict(stage=2, offload_optimizer="cpu"),
            "zero_offload_stage3": dict(stage=3),
            "zero_offload_stage3_offload": dict(
                stage=3, offload_optimizer="cpu", offload_param="cpu"
            ),
            "zero_offload_stage3_offload_nvme": dict(
                stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=NVME_ENV
            ),
        }
        for name, kw in names.items():
            if name not in registry:
                registry.register(name, cls, description=f"zero_offload {kw or 'defaults'}", **kw)


ZeroOffloadStrategy.register_strategies(StrategyRegistry)
