"""Hugging Face ``Trainer`` on zero_offload: one change to a training script.

    from zero_offload.integrations.hf import ZeroOffloadTrainer
    trainer = ZeroOffloadTrainer(model=model, args=args, train_dataset=ds,
                                 zero_offload=dict(stage=3, offload_optimizer="nvme",
                                                   nvme_path="/mnt/nvme"))
    trainer.train(); trainer.save_model()

``zero_offload`` takes :func:`zero_offload.initialize` keywords, or a JSON file of them, or a
DeepSpeed config (its ``"auto"`` values filled from ``TrainingArguments`` as Hugging Face's
DeepSpeed integration does). ``TrainingArguments`` supply the AdamW hyperparameters
(``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``, with Trainer's
no-decay group of biases and norm weights as ``no_decay``), ``max_grad_norm`` and the compute
dtype (``bf16`` / ``fp16``); keywords given in ``zero_offload`` win.

How it plugs in (the Trainer methods overridden, and why):
- ``create_optimizer`` builds the engine and hands Trainer :class:`EngineOptimizer`, whose
  ``param_groups`` are the engine's (Trainer's lr scheduler drives them) and whose ``step`` is
  the engine's step (reduce, unscale, clip by ``max_grad_norm``, update).
- ``_wrap_model`` returns :class:`EngineModule` (forward through the engine, which gathers
  stage-3 parameters), not the model: Accelerate then prepares only the optimizer and never
  wraps the model in DDP (the engine reduces gradients itself).
- ``training_step`` backpropagates through the engine, which runs with
  ``gradient_accumulation_steps=1``: Trainer divides the loss for accumulation and says which
  micro-batch ends the window (``final``); the engine scales only by the fp16 loss scale.
- Accelerate gets the optimizer as already prepared and asks it ``step_was_skipped``: a step
  skipped on an fp16 overflow does not advance Trainer's lr scheduler (as with DeepSpeed).
- ``_clip_grad_norm`` / ``_get_grad_norm``: the engine clips at its step, over all shards; the
  norm is logged after the step (``grad_norm``) with the engine's step stats.
- ``compute_loss``: with ``tiled_loss`` (tokens per tile) a causal LM's training loss is the
  tiled one (``zero_offload.activations.tiled_loss``: the full logits never exist), run as a
  forward of the engine; Trainer still adds what it adds (``num_items_in_batch``, the
  scaling for ``average_tokens_across_devices``). Where ``compute_loss`` is asked for the
  outputs too (evaluation; TRL's SFTTrainer, which reads the logits), the plain loss runs.
- Checkpoints: ``save_model`` writes consolidated safetensors (``engine.full_state_dict()``);
  a Trainer checkpoint also holds ``zero_offload/`` (``engine.save_checkpoint``: fp32
  masters and optimizer state, any tier) from which ``resume_from_checkpoint`` restores;
  it also resumes a checkpoint that Trainer saved with DeepSpeed (``global_stepN/``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn as nn
from transformers import Trainer

from ..activations.tiled_loss import check_tiled_model
from ..checkpoint.tags import TRAINER_SUBDIR
from ..config import ConfigError
from ..engine.engine import Engine, initialize
from .common import EngineOptimizer, step_stats
from .hf_keywords import deepspeed_schedule, engine_keywords
from .hf_preemption import PreemptionCallback
from .hf_tiled import tiled_loss_model
from .preemption import check_trainer_preemption

__all__ = [
    "ZeroOffloadTrainer",
    "ZeroOffloadMixin",
    "zero_offload_trainer",
    "EngineModule",
    "EngineOptimizer",
    "engine_keywords",
]

log = logging.getLogger(__name__)

ENGINE_DIR = TRAINER_SUBDIR  # inside a Trainer checkpoint folder
SCHEDULER_NAME = "scheduler.pt"


class EngineModule(nn.Module):
    """The model as Trainer runs it: forward goes through the engine (inputs moved to its
    device and dtype, stage-3 parameters gathered around each module)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.module
        self._engine = engine  # not an nn.Module: kept out of the module tree

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine(*args, **kwargs)


class _PreparedEngineOptimizer(EngineOptimizer):
    """Accelerate takes it as it is (no ``AcceleratedOptimizer`` around it) and asks it
    ``step_was_skipped``: Trainer's lr scheduler then does not advance on a step skipped on an
    fp16 overflow."""

    _is_accelerate_prepared = True


if TYPE_CHECKING:  # the mixin is checked as the Trainer it goes before
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class ZeroOffloadMixin(_TrainerBase):
    """The overrides that put a zero_offload engine under a ``Trainer`` (sub)class; mixed in
    before it (:class:`ZeroOffloadTrainer`, :func:`zero_offload_trainer`)."""

    def __init__(
        self,
        *args: Any,
        zero_offload: Mapping[str, Any] | str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.optimizer is not None:
            raise ConfigError(
                "ZeroOffloadTrainer builds its own optimizer (the engine's "
                "AdamW): do not pass optimizers=(...)"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ConfigError(
                "ZeroOffloadTrainer replaces DeepSpeed/FSDP: remove "
                "TrainingArguments.deepspeed / fsdp and pass the config as "
                "zero_offload=..."
            )
        self.zero_offload_config = zero_offload
        self.engine: Engine | None = None
        self._engine_module: EngineModule | None = None

    # -- the engine in place of the optimizer and the wrapped model ---------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.engine is None:
            if self.model is None:
                raise ConfigError(
                    "ZeroOffloadTrainer needs the model before its optimizer: "
                    "pass model= (or model_init=) to the Trainer"
                )
            kw = engine_keywords(
                self.args,
                self.model,
                self.zero_offload_config,
                self.get_decay_parameter_names(self.model),
            )
            self.engine = initialize(self.model, **kw)
            if check_trainer_preemption(self.engine, "ZeroOffloadTrainer"):
                self.add_callback(PreemptionCallback(self.engine))
            if self.engine.config.activations.tiled_loss:
                check_tiled_model(self.model)  # a clear error now, not at the first step
            self._engine_module = EngineModule(self.engine)
            if self.engine.dtype == torch.float16:  # the engine scales the loss itself
                self.accelerator.scaler = None
            log.info(
                "ZeroOffloadTrainer: %s",
                {k: f"{len(v)} parameters" if k == "no_decay" else v for k, v in kw.items()},
            )
        if self.optimizer is None:
            self.optimizer = _PreparedEngineOptimizer(self.engine)
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """Trainer's schedule, or the DeepSpeed config's ``scheduler`` where it has one (as
        Hugging Face's DeepSpeed integration runs it)."""
        target = optimizer or self.optimizer
        if self.lr_scheduler is None and target is not None:
            schedule = deepspeed_schedule(
                self.args, self.zero_offload_config, target, num_training_steps
            )
            if schedule is not None:
                self.lr_scheduler = schedule  # type: ignore[assignment]
                self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        if self._engine_module is not None:
            return self._engine_module
        return super()._wrap_model(model, training, dataloader)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        if self.engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if not isinstance(loss, torch.Tensor):  # a tuple comes only with return_outputs=True
            raise TypeError(f"compute_loss returned a {type(loss).__name__}, not the loss")
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:  # normalized by num_items_in_batch already (Trainer's own rule)
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        self.engine.backward(loss, final=self.accelerator.sync_gradients)
        return loss.detach()

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if self.engine is not None and model is self._engine_module:
            model = tiled_loss_model(self, model, inputs, return_outputs)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # the engine clips at its step, over every rank's shard

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # known after the step: logged with the engine's step stats

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.engine is not None and "loss" in logs:
            logs.update(step_stats(self.engine))
        super().log(logs, *args, **kwargs)

    # -- saving and resuming ------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated safetensors (``from_pretrained`` loads them). Collective: every rank
        calls it, as Trainer does."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        state_dict = self.engine.full_state_dict()
        self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if _engine_checkpoint(resume_from_checkpoint) is not None:
            return  # the engine checkpoint holds the fp32 masters: restored with the optimizer
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        directory = _engine_checkpoint(checkpoint)
        if directory is None:
            raise ConfigError(
                f"resume_from_checkpoint={checkpoint!r} holds no {ENGINE_DIR}/ engine "
                "checkpoint and no DeepSpeed one (latest, global_step*/): resume from a "
                "ZeroOffloadTrainer or DeepSpeed Trainer checkpoint"
            )
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        # Trainer saves scheduler.pt for its own schedules; a DeepSpeed run whose config's
        # "scheduler" drove the lr kept that schedule's state in its checkpoint instead
        from_engine = directory == checkpoint and not os.path.isfile(path)
        self.engine.load_checkpoint(
            directory, lr_scheduler=self.lr_scheduler if from_engine else None
        )
        if self.lr_scheduler is not None and os.path.isfile(path):
            from ..checkpoint.deepspeed_state import fit_scheduler_state

            state = torch.load(path, weights_only=True)  # a DeepSpeed run's may have 2 groups
            groups = len(self.lr_scheduler.optimizer.param_groups)
            self.lr_scheduler.load_state_dict(fit_scheduler_state(state, groups, path))

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's engine state (parameters, fp32
        masters, optimizer state), as Trainer does with DeepSpeed."""
        if self.engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        directory = os.path.join(best or "", ENGINE_DIR)
        if best is None or not os.path.isdir(directory):
            raise ConfigError(
                f"load_best_model_at_end: {best!r} holds no {ENGINE_DIR}/ engine "
                "checkpoint (ZeroOffloadTrainer did not save it); load its "
                "model.safetensors with from_pretrained instead"
            )
        log.info(
            "loading the best model from %s (%s = %s)",
            best,
            self.args.metric_for_best_model,
            self.state.best_metric,
        )
        self.engine.load_checkpoint(directory)

    def _save_scaler(self, output_dir: str) -> None:
        if self.engine is None:
            super()._save_scaler(output_dir)  # the engine's loss scale is in its checkpoint

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self.engine is None:
            super()._load_scaler(checkpoint)


def _engine_checkpoint(checkpoint: str) -> str | None:
    """What a Trainer checkpoint folder resumes from: its ``zero_offload/`` engine checkpoint,
    or the folder itself when a DeepSpeed run saved it (``latest`` naming ``global_stepN/``,
    read by ``engine.load_checkpoint``; Trainer's own ``scheduler.pt`` holds the lr schedule)."""
    if os.path.isdir(os.path.join(checkpoint, ENGINE_DIR)):
        return os.path.join(checkpoint, ENGINE_DIR)
    from ..checkpoint.deepspeed import find_deepspeed

    return checkpoint if find_deepspeed(Path(checkpoint)) is not None else None


class ZeroOffloadTrainer(ZeroOffloadMixin, Trainer):
    """``transformers.Trainer`` training through a zero_offload engine; ``zero_offload``:
    ``initialize`` keywords, a JSON file of them, or a DeepSpeed config (dict or file)."""


def zero_offload_trainer(trainer_class: type) -> type:
    """The same for a Trainer subclass, e.g. TRL's:
    ``zero_offload_trainer(SFTTrainer)(model=..., args=..., zero_offload=dict(stage=3))``."""
    if not issubclass(trainer_class, Trainer):
        raise TypeError(f"{trainer_class.__name__} is not a transformers.Trainer subclass")
    return type(f"ZeroOffload{trainer_class.__name__}", (ZeroOffloadMixin, trainer_class), {})
