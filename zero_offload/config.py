"""Every knob of the engine, as one typed dataclass tree, validated up front.

Users pass flat keyword arguments (``initialize(model, stage=3, lr=1e-4, ...)``) or the same keys
as a dict or JSON file (``config=...``). Each flat key belongs to one section of the tree; the
sections keep related knobs together and keep ``Engine`` code from reaching into a bag of loose
values. A bad key or value raises :class:`ConfigError` naming the key, the value, what is allowed
and, for a misspelt key, the closest valid one.
"""

from __future__ import annotations

import difflib
import json
import numbers
import os
import typing
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from .activations.config import ActivationConfig
from .device.threads import check_threads
from .deepspeed_config import check_schedule, is_deepspeed, keyword_autos, translate
from .errors import ConfigError
from .fields import keyword
from .optim.policy import StatePolicy


_POLICY_FIELDS = {
    "optimizer_type": "kind",
    "moment_precision": "moments",
    "master_precision": "master",
}

__all__ = [
    "ActivationConfig",
    "ConfigError",
    "OptimizerConfig",
    "PrecisionConfig",
    "OffloadConfig",
    "ZeroConfig",
    "build_config",
    "config_keys",
    "keyword_fields",
]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_OFFLOAD_TARGETS = ("none", "cpu", "nvme")


def _bad(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is not valid: {allowed}")


def _number(
    key: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    integer: bool = False,
) -> float | int:
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(key, value, f"expected {kind}")
    if integer and not float(value).is_integer():
        raise _bad(key, value, f"expected {kind}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise _bad(key, value, f"expected {kind} {'>' if lo_open else '>='} {lo:g}")
    if hi is not None and value > hi:
        raise _bad(key, value, f"expected {kind} <= {hi:g}")
    return int(value) if integer else float(value)


def compute_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The ``dtype`` key's value (a torch dtype or its name) as a torch dtype."""
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPES:
            raise _bad("dtype", dtype, "expected float32, bfloat16 or float16")
        dtype = _DTYPES[dtype.removeprefix("torch.")]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise _bad("dtype", dtype, "expected torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def _whole_numbers(section: Any) -> None:
    """Store every ``int``-typed field of a config dataclass as a real int.

    Why: JSON and YAML configs routinely carry ``8e9`` or ``2.0``; a float that reaches a slice
    or a buffer count fails far from the config, so an integral float becomes its int here
    and a fractional one (or nan/inf) is refused naming the key. Reads the type hints, so a
    new whole-number field is covered without being listed.
    """
    hints = typing.get_type_hints(type(section))
    renamed = {name: key for key, (_, name) in _RENAMES.items()}
    for f in fields(section):
        if hints[f.name] not in (int, int | None):
            continue
        value = getattr(section, f.name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue  # None, or a wrong type the field's own check names
        if isinstance(value, numbers.Integral):
            whole = int(value)
        elif float(value).is_integer():
            whole = int(float(value))
        else:
            key = renamed.get(f.name, f.name)
            raise _bad(key, value, "expected an integer (a float must be whole, e.g. 8e9)")
        object.__setattr__(section, f.name, whole)


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
        "None: no clipping",
    )
    no_decay: tuple[str, ...] = keyword(
        (),
        "names (as in `model.named_parameters()`) of parameters stepped without weight decay: "
        "biases and norm weights, the no-decay group of Hugging Face Trainer; an unknown name "
        "is a `ConfigError`",
    )

    def __post_init__(self) -> None:
        _whole_numbers(self)
        policy = self.policy  # validates the three keys
        for key in ("optimizer_type", "moment_precision", "master_precision"):
            object.__setattr__(self, key, getattr(policy, _POLICY_FIELDS[key]).value)
        if self.betas is None:
            object.__setattr__(self, "betas", policy.kind.default_betas)
        if self.eps is None:
            object.__setattr__(self, "eps", policy.kind.default_eps)
        _number("lr", self.lr, lo=0.0)
        if not isinstance(self.no_decay, (list, tuple, set, frozenset)) or not all(
            isinstance(n, str) for n in self.no_decay
        ):
            raise _bad(
                "no_decay",
                self.no_decay,
                "expected a list of parameter names, e.g. ['fc.bias', 'norm.weight']",
            )
        object.__setattr__(self, "no_decay", tuple(self.no_decay))
        if (
            not isinstance(self.betas, (tuple, list))
            or len(self.betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas)
        ):
            raise _bad("betas", self.betas, "expected two numbers in [0, 1), e.g. (0.9, 0.999)")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        _number("eps", self.eps, lo=0.0, lo_open=True)
        _number("weight_decay", self.weight_decay, lo=0.0)
        if self.max_grad_norm is not None:
            _number("max_grad_norm", self.max_grad_norm, lo=0.0, lo_open=True)

    @property
    def policy(self) -> StatePolicy:
        """The optimizer kind and state precisions as one type (decided here, once)."""
        try:
            return StatePolicy.parse(
                self.optimizer_type, self.moment_precision, self.master_precision
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def adam_betas(self) -> tuple[float, float]:
        """``betas`` as resolved (never None once built)."""
        assert self.betas is not None
        return self.betas


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute dtype of params/grads (the optimizer's master copy is ``master_precision``,
    float32 by default) and the dynamic loss scaler used with float16."""

    dtype: torch.dtype = keyword(
        torch.float32,
        "compute dtype of the parameters and gradients: float32, bfloat16 or float16 (a torch "
        "dtype or its name). The optimizer's master copy is `master_precision`: with float32 "
        "at stage 0, or at stage 3 with the shards beside the optimizer, the parameters "
        "themselves",
    )
    initial_loss_scale: float = keyword(2.0**16, "float16: the dynamic loss scale's start")
    loss_scale_window: int = keyword(1000, "float16: overflow-free steps before the scale doubles")
    min_loss_scale: float = keyword(1.0, "float16: the scale never halves below this")
    loss_scale_hysteresis: int = keyword(
        1, "float16: overflows the scale absorbs before it halves (DeepSpeed's `hysteresis`)"
    )
    consecutive_hysteresis: bool = keyword(
        False, "float16: each overflow-free step refills the hysteresis"
    )
    skip_nonfinite_steps: bool = keyword(
        False,
        "bfloat16 / float32: skip a step whose gradients hold inf or NaN (counted in "
        "`engine.skipped_steps`; float16 always does). DeepSpeed configs with `bf16` turn it "
        "on, as DeepSpeed's `check_grad_overflow`",
    )

    def __post_init__(self) -> None:
        _whole_numbers(self)
        object.__setattr__(self, "dtype", compute_dtype(self.dtype))
        _number("initial_loss_scale", self.initial_loss_scale, lo=0.0, lo_open=True)
        _number("loss_scale_window", self.loss_scale_window, lo=1, integer=True)
        _number("min_loss_scale", self.min_loss_scale, lo=0.0, lo_open=True)
        _number("loss_scale_hysteresis", self.loss_scale_hysteresis, lo=1, integer=True)
        for key in ("consecutive_hysteresis", "skip_nonfinite_steps"):
            if not isinstance(getattr(self, key), bool):
                raise _bad(key, getattr(self, key), "expected True or False")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the optimizer state and (stage 3) the parameter shards live."""

    # key: offload_optimizer
    optimizer: str = keyword(
        "none",
        '"cpu" or "nvme": where the fp32 master and the optimizer\'s moments live (stages 1-3); '
        "see [offload.md](offload.md)",
    )
    # key: offload_param
    param: str = keyword(
        "none", '"cpu" or "nvme": where stage 3\'s parameter shards live between uses'
    )
    nvme_path: str | None = keyword(
        None, 'a directory on a fast local disk, needed with "nvme"; run files go under it'
    )
    host_memory_limit: int | None = keyword(
        None,
        "bytes of host memory this rank's pools and staging buffers share (NVMe parameter "
        "pool, NVMe optimizer buffers, the fp32 gradient shard or its swap buffers); the "
        "default is taken once per rank so that the ranks of a node share half of its "
        "available RAM. When the fp32 gradient shard does not fit beside the optimizer's "
        "buffers, gradients go to NVMe beside the optimizer state. See "
        "[host_memory.md](host_memory.md)",
        shown="the node's available RAM × 0.5 / `LOCAL_WORLD_SIZE`",
    )
    sub_group_size: int = keyword(
        100_000_000,
        "most parameters stepped at a time with the optimizer on NVMe; the sub-group used is "
        "8M parameters (a quarter of a smaller shard), shrunk to fit `host_memory_limit`",
    )
    # key: offload_optimizer_fraction
    optimizer_fraction: float | str | None = keyword(
        None,
        'with `offload_optimizer="nvme"`: the share of the optimizer state kept in files, 0 '
        "to 1; the leading sub-groups of each rank's shard keep their fp32 master and moments "
        'in host memory and are stepped while the first file is read. "auto": as much in host '
        "memory as this rank's share of `host_memory_limit` holds beside the NVMe buffers, the "
        "rest in files (what `zero-offload plan` picks). Results are bit for bit those of any "
        "other split. See [tiers.md](tiers.md)",
        shown="1.0 (all in files)",
    )
    # key: offload_param_fraction
    param_fraction: float | None = keyword(
        None,
        'stage 3 with `offload_param="nvme"`: the share of the rank\'s parameter shards kept in '
        "files, 0 to 1, by whole units; the leading units keep their shards in host memory and "
        "are gathered without a disk read. See [tiers.md](tiers.md)",
        shown="1.0 (all in files)",
    )

    def __post_init__(self) -> None:
        _whole_numbers(self)
        for key, value in (("offload_optimizer", self.optimizer), ("offload_param", self.param)):
            if value is None:
                value = "none"
            if value not in _OFFLOAD_TARGETS:
                raise _bad(key, value, "expected 'none', 'cpu' or 'nvme'")
        object.__setattr__(self, "optimizer", self.optimizer or "none")
        object.__setattr__(self, "param", self.param or "none")
        uses_nvme = "nvme" in (self.optimizer, self.param)
        if uses_nvme and not self.nvme_path:
            raise ConfigError(
                "offload to 'nvme' needs nvme_path: pass nvme_path='/path/on/a/fast/disk'"
            )
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)):
                raise _bad("nvme_path", self.nvme_path, "expected a directory path")
            object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))
        if self.host_memory_limit is not None:
            _number("host_memory_limit", self.host_memory_limit, lo=1, integer=True)
        _number("sub_group_size", self.sub_group_size, lo=1, integer=True)
        self._check_fraction()

    def _check_fraction(self) -> None:
        if self.param_fraction is not None:
            value = _number("offload_param_fraction", self.param_fraction, lo=0.0, hi=1.0)
            if value != value:
                raise _bad("offload_param_fraction", value, "expected a number in [0, 1]")
            object.__setattr__(self, "param_fraction", value)
            if self.param != "nvme":
                raise ConfigError(
                    f"offload_param_fraction={value!r} splits the parameter shards between "
                    f"host memory and NVMe, so it needs offload_param='nvme' (got "
                    f"{self.param!r}); set offload_param='nvme' and nvme_path, or drop "
                    "offload_param_fraction"
                )
        fraction = self.optimizer_fraction
        if fraction is None:
            return
        if fraction != "auto":
            if isinstance(fraction, str):
                raise _bad(
                    "offload_optimizer_fraction",
                    fraction,
                    "expected a number in [0, 1] (the share on NVMe) or 'auto'",
                )
            fraction = _number("offload_optimizer_fraction", fraction, lo=0.0, hi=1.0)
            if fraction != fraction:  # nan passes both bounds
                raise _bad("offload_optimizer_fraction", fraction, "expected a number in [0, 1]")
            object.__setattr__(self, "optimizer_fraction", fraction)
        if self.optimizer != "nvme":
            raise ConfigError(
                f"offload_optimizer_fraction={fraction!r} splits the optimizer state between host "
                f"memory and NVMe, so it needs offload_optimizer='nvme' (got "
                f"{self.optimizer!r}); set offload_optimizer='nvme' and nvme_path, or drop "
                "offload_optimizer_fraction"
            )

    @property
    def enabled(self) -> bool:
        return self.optimizer != "none" or self.param != "none"

    @property
    def nvme_dir(self) -> str:
        """``nvme_path``, for a tier on NVMe (validation let that through only with one)."""
        if not self.nvme_path:
            raise ConfigError(
                "offload to 'nvme' needs nvme_path: pass nvme_path='/path/on/a/fast/disk'"
            )
        return self.nvme_path


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
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    activations: ActivationConfig = field(default_factory=ActivationConfig)

    def __post_init__(self) -> None:
        _whole_numbers(self)
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise _bad("stage", self.stage, "expected 0, 1, 2 or 3")
        _number("gradient_accumulation_steps", self.gradient_accumulation_steps, lo=1, integer=True)
        _number("reduce_bucket_size", self.reduce_bucket_size, lo=1, integer=True)
        _number("prefetch_depth", self.prefetch_depth, lo=0, integer=True)
        if self.prefetch_bytes is not None:
            _number("prefetch_bytes", self.prefetch_bytes, lo=0, integer=True)
        _number("param_persistence_threshold", self.param_persistence_threshold, lo=0, integer=True)
        if not isinstance(self.broadcast_buffers, bool):
            raise _bad("broadcast_buffers", self.broadcast_buffers, "expected True or False")
        if not isinstance(self.overlap_step, bool):
            raise _bad("overlap_step", self.overlap_step, "expected True or False")
        if not isinstance(self.step_during_backward, bool):
            raise _bad("step_during_backward", self.step_during_backward, "expected True or False")
        check_threads(self.threads)
        if self.lr_schedule is not None:
            check_schedule(self.lr_schedule, self.optimizer.lr)
        if self.device is not None:
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError) as exc:
                raise _bad(
                    "device",
                    self.device,
                    "expected a torch.device or a string such as 'cuda:0' or 'cpu'",
                ) from exc
        if self.init_weights is not None:
            if not isinstance(self.init_weights, (str, os.PathLike)):
                raise _bad("init_weights", self.init_weights, "expected a file or folder path")
            object.__setattr__(self, "init_weights", os.fspath(self.init_weights))
            if not os.path.exists(self.init_weights):
                raise _bad("init_weights", self.init_weights, "no such file or folder")
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
    def dtype(self) -> torch.dtype:
        return self.precision.dtype


# Flat user-facing key -> (section attribute or None for top level, field name).
_SECTIONS = {
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "offload": OffloadConfig,
    "activations": ActivationConfig,
}
_RENAMES = {
    "offload_optimizer": ("offload", "optimizer"),
    "offload_param": ("offload", "param"),
    "offload_optimizer_fraction": ("offload", "optimizer_fraction"),
    "offload_param_fraction": ("offload", "param_fraction"),
    "offload_activations": ("activations", "mode"),
    "offload_activations_min_bytes": ("activations", "min_bytes"),
    "offload_activations_prefetch": ("activations", "prefetch"),
}


def _flat_keys() -> dict[str, tuple[str | None, str]]:
    keys: dict[str, tuple[str | None, str]] = {
        f.name: (None, f.name) for f in fields(ZeroConfig) if f.name not in _SECTIONS
    }
    renamed = {target: key for key, target in _RENAMES.items()}
    for section, cls in _SECTIONS.items():
        for f in fields(cls):
            keys[renamed.get((section, f.name), f.name)] = (section, f.name)
    return keys


def config_keys() -> list[str]:
    """Every keyword ``initialize`` accepts."""
    return sorted(_flat_keys())


def keyword_fields() -> list[tuple[str, type, Field[Any]]]:
    """Every keyword with the dataclass that declares it and its field, in declaration order
    (the top level first): what ``zero-offload keywords`` writes the reference from."""
    out = []
    for key, (section, name) in _flat_keys().items():
        cls: type = _SECTIONS[section] if section else ZeroConfig
        out.append((key, cls, next(f for f in fields(cls) if f.name == name)))
    return out


def _load(config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config={str(path)!r}: no such file") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config={str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config={str(path)!r} must hold a JSON object of keyword arguments")
    return data


def build_config(
    config: Mapping[str, Any] | str | os.PathLike | None = None, **kwargs: Any
) -> ZeroConfig:
    """Build and validate a :class:`ZeroConfig` from a dict / JSON path and keyword arguments
    (keywords win over the file). A DeepSpeed config is translated (:mod:`.deepspeed_config`), its
    ``"auto"`` values taken from the keywords of the same meaning (``lr``, ``dtype``, ...)."""
    if isinstance(config, ZeroConfig):
        if kwargs:
            raise ConfigError("pass either a ZeroConfig or keyword arguments, not both")
        return config
    loaded = _load(config)
    if is_deepspeed(loaded):  # its "auto" values: what the keywords say
        loaded = translate(loaded, keyword_autos(kwargs))
    values = {**loaded, **kwargs}
    keys = _flat_keys()
    unknown = [k for k in values if k not in keys]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(keys), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown keyword {key!r}{hint}; valid keywords: {', '.join(sorted(keys))}"
        )
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for key, value in values.items():
        section, name = keys[key]
        (sections[section] if section else top)[name] = value
    try:
        built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
        return ZeroConfig(**top, **built)
    except TypeError as exc:  # a value of a type the dataclass cannot even hold
        raise ConfigError(str(exc)) from exc


def describe(cfg: ZeroConfig) -> dict[str, Any]:
    """A JSON-friendly flat view of the config, e.g. for logs and checkpoint manifests."""
    out: dict[str, Any] = {}
    for key, (section, name) in _flat_keys().items():
        value = getattr(getattr(cfg, section) if section else cfg, name)
        if key == "process_group":
            continue
        out[key] = str(value) if isinstance(value, (torch.dtype, torch.device)) else value
    return out
