"""The whole configuration: the top-level keywords and the sections, checked together."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..activations.config import ActivationConfig
from ..deepspeed_config import check_schedule
from ..device.threads import check_threads
from ..errors import ConfigError
from ..fields import keyword
from ..policies import Stage
from .checks import bad, number, whole_numbers
from .offload import OffloadConfig
from .optimizer import OptimizerConfig
from .precision import PrecisionConfig

__all__ = ["ZeroConfig"]


@dataclass(frozen=True)
class ZeroConfig:
    """The whole configuration. Build it with :func:`build_config`."""

    stage: int = keyword(
        0,
        "0: data parallel; 1: the optimizer state sharded across ranks; 2: the gradients too; "
        "3: the parameters too",
    )
    gradient_accumulation_steps: int = keyword(
        1,
        "micro-steps per update: `engine.backward` scales the loss by its inverse and "
        "`engine.step()` applies the update on the last one",
    )
    reduce_bucket_size: int = keyword(
        25_000_000, "stages 0-2: elements per gradient bucket reduced at once"
    )
    prefetch_depth: int = keyword(
        2,
        "stage 3: modules gathered ahead of the one running (from NVMe the reads run this many "
        "modules ahead and the all-gathers one less)",
    )
    prefetch_bytes: int | None = keyword(
        None, "stage 3: a cap on the bytes gathered ahead; None: no cap"
    )
    param_persistence_threshold: int = keyword(
        0, "stage 3: modules with fewer parameters stay gathered throughout"
    )
    process_group: Any = keyword(
        None, "the data-parallel `torch.distributed` process group; None: the default (world)"
    )
    device: torch.device | None = keyword(
        None,
        "the compute device (a `torch.device` or a string); a CUDA device is made current "
        "(`torch.cuda.set_device`)",
        shown="cuda:(LOCAL_RANK mod visible GPUs), else cpu",
    )
    init_weights: str | None = keyword(
        None,
        "a safetensors file or a Hugging Face folder (with its index) to start from, streamed "
        "tensor by tensor; persistent buffers in it are loaded (the model keeps its own where "
        "the file has none), so a saved `state_dict()` and the file `zero-offload consolidate` "
        "writes both work",
    )
    broadcast_buffers: bool = keyword(
        True,
        "module buffers (BatchNorm statistics) follow rank 0's: broadcast at `initialize` and "
        "before each training forward, as `DistributedDataParallel` does",
    )
    overlap_step: bool = keyword(
        True,
        'stage 3 with `offload_optimizer="nvme"`: `step()` agrees on the gradients and starts '
        "the update, and the sub-groups are stepped while the next forward runs, each before "
        "the first module that reads its parameters, so the optimizer's disk traffic runs under "
        "the forward's compute. Results are bit for bit those of `overlap_step=False`; every "
        "engine method but the forward (and `engine.finish_step()`) first waits for the update "
        "to end. Applies when every trained unit is sharded (`param_persistence_threshold` "
        "leaves none whole). See [bench_step.md](bench_step.md)",
    )
    step_during_backward: bool = keyword(
        True,
        'stages 2-3 with `offload_optimizer="nvme"`, gradients in host memory, no clipping '
        "(`max_grad_norm=None`) and no float16 loss scaling: during the backward that ends an "
        "accumulation window, each sub-group whose gradients are complete is stepped by a "
        "thread of its own, its new state written beside the old and its new values to a file; "
        "`step()` adopts what it finished when it computed exactly what the step computes "
        "(same hyperparameters, step counts, every parameter with a gradient, no late piece) "
        "and steps the rest, or drops it. Parameters never change before `step()`; results are "
        "bit for bit those of `step_during_backward=False`. Needs room on `nvme_path` for 12 "
        "more bytes a parameter of the sub-groups in files, plus their new values (2 bytes in "
        'bf16, 4 in fp32); a full disk drops the pass. `engine.last_step["early_groups"]` says '
        "how many sub-groups a step adopted. See [bench_step.md](bench_step.md)",
    )
    threads: int | Mapping[str, int] | None = keyword(
        None,
        "threads per kind of CPU work of a rank: a mapping of `compute` (torch's intra-op "
        "threads), `optimizer` (the CPU optimizer kernel in the step), `background` (the "
        "kernel while a forward or backward computes beside it) and `io` (disk requests in "
        "flight per swap engine) to counts, or an int for compute and optimizer. None: the "
        "rule of [threads.md](threads.md), from the CPUs this process may use and "
        "`LOCAL_WORLD_SIZE`; `engine.threads` is what a run got",
    )
    lr_schedule: Mapping[str, Any] | None = keyword(
        None,
        'a DeepSpeed `scheduler` section (`{"type": "WarmupLR", "params": {...}}`: '
        "WarmupLR, WarmupDecayLR, WarmupCosineLR): `engine.lr_scheduler`, stepped after each "
        "applied update and saved with checkpoints, as DeepSpeed runs it",
    )
    save_on_preemption: str | bool | None = keyword(
        None,
        "a folder: on SIGTERM (how schedulers preempt) or SIGINT the step in flight ends, the "
        "ranks agree at the `step()` that ends an accumulation window (a one-integer "
        "all-reduce, since a signal reaches each rank at its own moment), every rank saves a "
        "checkpoint there (`load_checkpoint` resumes it) and the process exits with status "
        "128 + the signal's number. `True`: the ranks agree and `engine.preempted` names the "
        "signal; the caller saves (`ZeroOffloadTrainer` and the Lightning strategy save the "
        "Trainer's own checkpoint, which `resume_from_checkpoint` / `ckpt_path` find). A "
        "second signal acts as without it. See [preemption.md](preemption.md)",
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    activations: ActivationConfig = field(default_factory=ActivationConfig)

    def __post_init__(self) -> None:
        whole_numbers(self)
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise bad("stage", self.stage, "expected 0, 1, 2 or 3")
        number("gradient_accumulation_steps", self.gradient_accumulation_steps, lo=1, integer=True)
        number("reduce_bucket_size", self.reduce_bucket_size, lo=1, integer=True)
        number("prefetch_depth", self.prefetch_depth, lo=0, integer=True)
        if self.prefetch_bytes is not None:
            number("prefetch_bytes", self.prefetch_bytes, lo=0, integer=True)
        number("param_persistence_threshold", self.param_persistence_threshold, lo=0, integer=True)
        if not isinstance(self.broadcast_buffers, bool):
            raise bad("broadcast_buffers", self.broadcast_buffers, "expected True or False")
        if not isinstance(self.overlap_step, bool):
            raise bad("overlap_step", self.overlap_step, "expected True or False")
        if not isinstance(self.step_during_backward, bool):
            raise bad("step_during_backward", self.step_during_backward, "expected True or False")
        check_threads(self.threads)
        self._check_preemption()
        if self.lr_schedule is not None:
            check_schedule(self.lr_schedule, self.optimizer.lr)
        if self.device is not None:
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError) as exc:
                raise bad(
                    "device",
                    self.device,
                    "expected a torch.device or a string such as 'cuda:0' or 'cpu'",
                ) from exc
        if self.init_weights is not None:
            if not isinstance(self.init_weights, (str, os.PathLike)):
                raise bad("init_weights", self.init_weights, "expected a file or folder path")
            object.__setattr__(self, "init_weights", os.fspath(self.init_weights))
            if not os.path.exists(self.init_weights):
                raise bad("init_weights", self.init_weights, "no such file or folder")
        if self.offload.param != "none" and self.stage != 3:
            raise ConfigError(
                f"offload_param={self.offload.param!r} needs stage=3 (got stage={self.stage}): "
                "only stage 3 shards the parameters; use stage=3 or offload_param='none'"
            )
        if self.offload.optimizer != "none" and self.stage == 0:
            raise ConfigError(
                f"offload_optimizer={self.offload.optimizer!r} needs stage 1, 2 or 3 (got stage=0)"
            )

    @property
    def sharding(self) -> Stage:
        """What ``stage`` shards, and what that asks of each part."""
        return Stage(self.stage)

    @property
    def dtype(self) -> torch.dtype:
        return self.precision.dtype

    def _check_preemption(self) -> None:
        value = self.save_on_preemption
        if value is None or isinstance(value, bool):
            if value is False:
                object.__setattr__(self, "save_on_preemption", None)
            return
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise bad("save_on_preemption", value, "expected a checkpoint folder, True or None")
        object.__setattr__(self, "save_on_preemption", os.fspath(value))
