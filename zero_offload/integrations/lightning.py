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
``lightning.pt`` with Lightning's own state (loops, schedulers, callbacks). On one process the
loaders keep their own samplers (as with ``strategy="auto"``). A DeepSpeed config is read as
Lightning's ``DeepSpeedStrategy`` reads it (``docs/deepspeed.md``).
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
from lightning.pytorch.utilities.types import LRSchedulerConfig

from ..config import ConfigError
from ..engine.engine import Engine, initialize
from .common import EngineOptimizer, step_stats
from .lightning_keywords import NVME_ENV, StrategyConfig, config_schedule
from .lightning_optimizers import check_covers, hyperparameters, retarget
from .lightning_preemption import PreemptionCallback
from .optimizers import POLICY_KEYS
from .preemption import check_trainer_preemption

__all__ = ["ZeroOffloadStrategy"]

log = logging.getLogger(__name__)

LIGHTNING_STATE = "lightning.pt"  # Lightning's own checkpoint entries, beside the engine's


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
        self.zero_offload = StrategyConfig(config, keywords)
        self.engine: Engine | None = None
        self._final = False  # the backward running ends an accumulation window

    # -- building the engine ----------------------------------------------------------------
    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Around ``configure_model``: at stage 3 its modules are built on the meta device,
        and the engine materializes them one unit at a time, each straight into its shards
        (``reset_parameters``, or the ``init_weights`` file): no rank ever holds the whole
        model. Other stages build it as usual."""
        if self.zero_offload.shards_params():
            with torch.device("meta"):
                yield
        else:
            yield

    def _deepspeed_schedule(self, trainer: Any, config: Mapping[str, Any]) -> None:
        """The config's ``scheduler``, where ``configure_optimizers`` gave none (DeepSpeed
        runs the client's schedule first), stepped at every optimizer step."""
        assert self.engine is not None
        if self.lr_scheduler_configs or "scheduler" not in config:
            return
        lr = self.engine.optimizer.param_groups[0]["lr"]
        schedule = config_schedule(
            self.optimizers[0], config, lr, trainer.estimated_stepping_batches
        )
        self.lr_scheduler_configs = [LRSchedulerConfig(schedule, interval="step")]

    def _keep_the_loaders_sampler(self, trainer: Any) -> None:
        """At world size 1, a loader keeps its own sampler, as under ``strategy="auto"``.

        Lightning gives every DDP-based strategy a ``DistributedSampler`` that shuffles the
        training set (even a ``shuffle=False`` loader's) unless ``use_distributed_sampler``
        is off; on one process that only changes the order. The flag lives on the Trainer's
        accelerator connector, read when the loaders are set up, after this ``setup``."""
        connector = getattr(trainer, "_accelerator_connector", None)
        if self.world_size == 1 and connector and connector.use_distributed_sampler:
            connector.use_distributed_sampler = False
            log.info("ZeroOffloadStrategy on one process: the loaders keep their own samplers")

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert self.accelerator is not None and self.model is not None and module is not None
        self.accelerator.setup(trainer)
        self._keep_the_loaders_sampler(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.engine is None:
            config = self.zero_offload.deepspeed()
            user_opt = None
            if config is not None and "optimizer" in config:
                # as Lightning's DeepSpeedStrategy: the config's optimizer (decaying every
                # parameter) and schedule; configure_optimizers only fills its "auto" values
                hyper: dict[str, Any] = {}
                if "auto" in str(config["optimizer"]):
                    self.setup_optimizers(trainer)
                    hyper = hyperparameters(self.optimizers[0], module)
                    for key in ("no_decay", *POLICY_KEYS):  # the config's optimizer decides
                        hyper.pop(key, None)
                if self.lr_scheduler_configs:
                    log.info(
                        "DeepSpeed config's optimizer: configure_optimizers' schedulers unused"
                    )
                self.lr_scheduler_configs = []
            else:
                self.setup_optimizers(trainer)  # configure_optimizers: the user's AdamW
                user_opt = self.optimizers[0] if len(self.optimizers) == 1 else None
                if user_opt is None:
                    raise ConfigError("configure_optimizers must return exactly one optimizer")
                check_covers(user_opt, module)
                hyper = hyperparameters(user_opt, module)
            kw = self.zero_offload.engine_keywords(trainer, hyper, self.world_size)
            self.engine = initialize(module, **kw)
            if check_trainer_preemption(self.engine, "ZeroOffloadStrategy"):
                trainer.callbacks.append(PreemptionCallback(self.engine))
            log.info(
                "ZeroOffloadStrategy: %s",
                {k: f"{len(v)} parameters" if k == "no_decay" else v for k, v in kw.items()},
            )
            engine_opt = EngineOptimizer(self.engine)
            if user_opt is not None:
                for lr_config in self.lr_scheduler_configs:
                    retarget(lr_config.scheduler, user_opt, engine_opt)
            self.optimizers = [engine_opt]
            if config is not None:
                self._deepspeed_schedule(trainer, config)
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
        """The engine's forward window around the whole step function, which may call
        submodules rather than the model (``engine.forward_window()``)."""
        if self.engine is None:
            yield
            return
        with self.engine.forward_window():
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
        assert self.engine is not None  # optimizer_step runs after setup built it
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
