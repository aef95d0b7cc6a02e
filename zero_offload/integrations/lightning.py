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

from ..config import ConfigError, load_config
from ..deepspeed_config import SCHEDULES, is_deepspeed, lr_scheduler, translate
from ..engine.engine import Engine, initialize
from ..policies import Stage
from .common import EngineOptimizer
from .lightning_optimizers import hyperparameters, retarget
from .lightning_preemption import PreemptionCallback
from .optimizers import POLICY_KEYS
from .preemption import check_trainer_preemption
from .stats import step_stats

__all__ = ["ZeroOffloadStrategy"]

log = logging.getLogger(__name__)

LIGHTNING_STATE = "lightning.pt"  # Lightning's own checkpoint entries, beside the engine's
NVME_ENV = "ZERO_OFFLOAD_NVME_PATH"  # nvme_path for the registered "..._nvme" names


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
    def _deepspeed(self) -> dict[str, Any] | None:
        """The config when it is a DeepSpeed one."""
        user = load_config(self.zero_offload_config)
        return user if is_deepspeed(user) else None

    def _stage(self) -> int:
        if "stage" in self.zero_offload_keywords:
            return int(self.zero_offload_keywords["stage"])
        user = load_config(self.zero_offload_config)
        if not is_deepspeed(user):
            return int(user.get("stage", 0))
        zero = user.get("zero_optimization", {})
        stage = zero.get("stage", 0) if isinstance(zero, Mapping) else int(bool(zero))
        return 0 if stage == "auto" else int(stage)

    def _shards_params(self) -> bool:
        """Whether the configured stage shards the parameters, read before the config is
        built (an invalid stage is named by the config's check, later)."""
        try:
            return Stage(self._stage()).shards_params
        except ValueError:
            return False

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Around ``configure_model``: at stage 3 its modules are built on the meta device,
        and the engine materializes them one unit at a time, each straight into its shards
        (``reset_parameters``, or the ``init_weights`` file): no rank ever holds the whole
        model. Other stages build it as usual."""
        if self._shards_params():
            with torch.device("meta"):
                yield
        else:
            yield

    def _auto_values(self, trainer: Any, hyper: Mapping[str, Any]) -> dict[str, Any]:
        """What the Lightning Trainer knows for a DeepSpeed config's "auto" values (batch
        sizes are the loaders': left unset)."""
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

    def _keywords(self, trainer: Any, hyper: dict[str, Any]) -> dict[str, Any]:
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
        user = load_config(self.zero_offload_config)
        if is_deepspeed(user):
            user = translate(
                user,
                self._auto_values(trainer, hyper),
                trainer="ZeroOffloadStrategy",
                defaults={"gradient_clipping": trainer.gradient_clip_val or 0.0},
                world=self.world_size,
            )
        kw.update(user)
        kw.update(self.zero_offload_keywords)
        gas = kw.pop("gradient_accumulation_steps", trainer.accumulate_grad_batches)
        if gas != trainer.accumulate_grad_batches:
            raise ConfigError(
                f"gradient_accumulation_steps={gas} in the zero_offload config "
                f"but accumulate_grad_batches={trainer.accumulate_grad_batches}: "
                "Lightning counts the micro-batches, so set it on the Trainer only"
            )
        return kw

    def _deepspeed_schedule(self, trainer: Any, config: Mapping[str, Any]) -> None:
        """The config's ``scheduler``, where ``configure_optimizers`` gave none (DeepSpeed
        runs the client's schedule first), stepped at every optimizer step."""
        assert self.engine is not None
        if self.lr_scheduler_configs or "scheduler" not in config:
            return
        resolve = {
            "warmup_min_lr": 0,
            "warmup_max_lr": self.engine.optimizer.param_groups[0]["lr"],
            "total_num_steps": trainer.estimated_stepping_batches,
        }
        section = config["scheduler"]
        for name, default in SCHEDULES.get(section.get("type"), {}).items():
            auto = (section.get("params") or {}).get(name) == "auto"
            if auto and name not in resolve and default is not None:  # Lightning has no warmup
                log.info('DeepSpeed config: scheduler.params.%s is "auto": %r', name, default)
                resolve[name] = default
        schedule = lr_scheduler(self.optimizers[0], config, resolve)
        self.lr_scheduler_configs = [LRSchedulerConfig(schedule, interval="step")]
        log.info("DeepSpeed config: its %s schedule drives the learning rate", schedule.kind)

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
            config = self._deepspeed()
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
                hyper = hyperparameters(user_opt, module)
            kw = self._keywords(trainer, hyper)
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
