"""DeepSpeed JSON configs, translated to zero_offload keywords.

People arrive with a DeepSpeed config from a recipe repository. :func:`translate` maps the
keys that mean the same thing here (ZeRO stage, offload targets, buckets, clipping, precision,
AdamW hyperparameters) to :func:`zero_offload.initialize` keywords. Keys whose job this library
does by itself (I/O buffers, pinning, live-parameter limits, ...) are accepted with one log line
saying why they are not needed. Anything else, and any ``"auto"`` value nobody resolved, is a
:class:`ConfigError` naming the key: a silently ignored setting would train differently from
what the user asked for.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from .errors import ConfigError

__all__ = ["is_deepspeed", "translate", "AUTO"]

log = logging.getLogger(__name__)

AUTO = "auto"

# Keys that only exist in DeepSpeed's format: their presence marks a dict as one.
_MARKERS = {
    "zero_optimization",
    "fp16",
    "bf16",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "scheduler",
    "aio",
    "optimizer",
}

# Keys accepted without effect, with the reason logged once per translation.
_SIZED_HERE = "zero_offload sizes its own buffers and I/O from the model and the memory budget"
_FREED_AFTER_USE = "gathered parameters are freed after their module runs"
_GATHERS_MASTERS = "full_state_dict() and consolidate_checkpoint always gather the fp32 masters"
_IGNORED: dict[str, str] = {
    "train_batch_size": "batch sizes belong to your data loader",
    "train_micro_batch_size_per_gpu": "batch sizes belong to your data loader",
    "steps_per_print": "zero_offload logs through Python logging (and your trainer's loggers)",
    "wall_clock_breakdown": "step timings are always in engine.last_step",
    "zero_allow_untested_optimizer": "zero_offload runs its own AdamW",
    "aio": _SIZED_HERE,
    "zero_optimization.aio": _SIZED_HERE,
    "zero_optimization.overlap_comm": "reductions always overlap the backward",
    "zero_optimization.contiguous_gradients": "gradients are always reduced into one flat shard",
    "zero_optimization.reduce_scatter": "gradients are always reduce-scattered (stages 1-3)",
    "zero_optimization.allgather_partitions": "updated shards are always all-gathered",
    "zero_optimization.allgather_bucket_size": "parameters are gathered unit by unit",
    "zero_optimization.round_robin_gradients": "shards are contiguous per rank",
    "zero_optimization.stage3_max_live_parameters": (
        "gathered parameters are freed after their module runs; prefetch is capped by "
        "stage3_prefetch_bucket_size"
    ),
    "zero_optimization.stage3_max_reuse_distance": _FREED_AFTER_USE,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _GATHERS_MASTERS,
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": _GATHERS_MASTERS,
    "zero_optimization.memory_efficient_linear": "zero_offload does not replace nn.Linear",
    "zero_optimization.elastic_checkpoint": "checkpoints load at any world size and stage",
    "zero_optimization.load_from_fp32_weights": "checkpoints always resume from fp32 masters",
    "zero_optimization.ignore_unused_parameters": "unused parameters count as zero gradients",
    "zero_optimization.offload_optimizer.pin_memory": _SIZED_HERE,
    "zero_optimization.offload_optimizer.buffer_count": _SIZED_HERE,
    "zero_optimization.offload_optimizer.fast_init": _SIZED_HERE,
    "zero_optimization.offload_optimizer.pipeline_read": "reads and writes are always pipelined",
    "zero_optimization.offload_optimizer.pipeline_write": "reads and writes are always pipelined",
    "zero_optimization.offload_param.pin_memory": _SIZED_HERE,
    "zero_optimization.offload_param.buffer_count": _SIZED_HERE,
    "zero_optimization.offload_param.buffer_size": _SIZED_HERE,
    "zero_optimization.offload_param.max_in_cpu": _SIZED_HERE,
    "fp16.hysteresis": "the loss scale halves at each overflow (hysteresis 1)",
    "fp16.consecutive_hysteresis": "the loss scale halves at each overflow (hysteresis 1)",
    "fp16.auto_cast": "inputs are cast to the compute dtype by the engine",
    "optimizer.params.torch_adam": "zero_offload runs its own AdamW",
}


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """True when ``data`` is in DeepSpeed's format rather than zero_offload's flat keywords."""
    return any(k in _MARKERS for k in data)


class _Reader:
    """Walks the config, records which dotted keys were used, resolves ``"auto"``."""

    def __init__(self, data: Mapping[str, Any], resolve: Mapping[str, Any]) -> None:
        self.data = data
        self.resolve = resolve
        self.seen: set[str] = set()

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        self.seen.add(path)
        if node == AUTO:
            if path not in self.resolve:
                raise ConfigError(
                    f'DeepSpeed config key {path!r} is "auto", which only a trainer '
                    "integration can fill in: give it a value"
                )
            return self.resolve[path]
        return node


def _number(path: str, value: Any, cast: Callable[[float], Any] = int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"DeepSpeed config key {path!r}={value!r}: expected a number")
    return cast(value)


def _leaves(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and path not in _IGNORED:
            out.extend(_leaves(value, path + "."))
        else:
            out.append(path)
    return out


def _offload(r: _Reader, section: str, out: dict[str, Any]) -> None:
    device = r.get(f"zero_optimization.{section}.device", "none")
    if device not in ("none", "cpu", "nvme", None):
        raise ConfigError(
            f"DeepSpeed config key 'zero_optimization.{section}.device'="
            f"{device!r}: expected 'none', 'cpu' or 'nvme'"
        )
    out[section] = device or "none"
    ratio = r.get(f"zero_optimization.{section}.ratio", 1.0)
    if ratio != 1.0:
        raise ConfigError(
            f"DeepSpeed config key 'zero_optimization.{section}.ratio'={ratio!r}: "
            "zero_offload offloads all of a rank's optimizer state or none; "
            "remove the key or set it to 1.0"
        )
    path = r.get(f"zero_optimization.{section}.nvme_path")
    if path is not None and device == "nvme":
        if out.get("nvme_path", path) != path:
            raise ConfigError(
                "DeepSpeed config: offload_optimizer.nvme_path and offload_param.nvme_path "
                f"differ ({out['nvme_path']!r}, {path!r}); zero_offload keeps both tiers under "
                "one nvme_path: give both the same directory"
            )
        out["nvme_path"] = path


def _precision(r: _Reader, out: dict[str, Any]) -> int:
    """Compute dtype and loss-scale keys; returns the dtype's size in bytes."""
    fp16 = bool(r.get("fp16.enabled", False)) if "fp16" in r.data else False
    bf16 = bool(r.get("bf16.enabled", False)) if "bf16" in r.data else False
    if fp16 and bf16:
        raise ConfigError("DeepSpeed config enables both 'fp16' and 'bf16': choose one")
    for name, enabled in (("fp16", fp16), ("bf16", bf16)):
        if not enabled and isinstance(r.data.get(name), Mapping):  # off: its keys do nothing
            r.seen.update(_leaves(r.data[name], name + "."))
    if bf16:
        out["dtype"] = "bfloat16"
    if not fp16:
        return 2 if bf16 else 4
    out["dtype"] = "float16"
    static = r.get("fp16.loss_scale", 0)
    if static not in (0, None):
        raise ConfigError(
            f"DeepSpeed config key 'fp16.loss_scale'={static!r}: zero_offload "
            "scales the loss dynamically only; set it to 0"
        )
    power = r.get("fp16.initial_scale_power")
    if power is not None:
        out["initial_loss_scale"] = 2.0 ** _number("fp16.initial_scale_power", power)
    window = r.get("fp16.loss_scale_window")
    if window is not None:
        out["loss_scale_window"] = _number("fp16.loss_scale_window", window)
    floor = r.get("fp16.min_loss_scale")
    if floor is not None:
        out["min_loss_scale"] = _number("fp16.min_loss_scale", floor, float)
    return 2


def _optimizer(r: _Reader, out: dict[str, Any]) -> None:
    if "optimizer" not in r.data:
        return
    kind = str(r.get("optimizer.type", "AdamW"))
    adamw = r.get("optimizer.params.adam_w_mode", True)
    if kind.lower() not in ("adam", "adamw") or (kind.lower() == "adam" and not adamw):
        raise ConfigError(
            f"DeepSpeed config key 'optimizer.type'={kind!r}: zero_offload runs "
            "AdamW (decoupled weight decay); use type 'AdamW'"
        )
    if r.get("optimizer.params.amsgrad", False):
        raise ConfigError(
            "DeepSpeed config key 'optimizer.params.amsgrad'=true is not supported: remove it"
        )
    for key in ("lr", "eps", "weight_decay"):
        value = r.get(f"optimizer.params.{key}")
        if value is not None:
            out[key] = _number(f"optimizer.params.{key}", value, float)
    betas = r.get("optimizer.params.betas")
    if betas is not None:
        out["betas"] = tuple(betas)


def translate(
    data: Mapping[str, Any],
    resolve: Mapping[str, Any] | None = None,
    *,
    allow: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The :func:`zero_offload.initialize` keywords equivalent to DeepSpeed config ``data``.

    ``resolve`` fills ``"auto"`` values by dotted key (what a trainer integration knows, e.g.
    ``{"optimizer.params.lr": 5e-5}``); ``allow`` names top-level sections the caller handles
    itself (a trainer's own lr ``scheduler``)."""
    r = _Reader(data, resolve or {})
    out: dict[str, Any] = {}
    stage = r.get("zero_optimization.stage", 0)
    out["stage"] = _number("zero_optimization.stage", stage)
    for section in ("offload_optimizer", "offload_param"):
        _offload(r, section, out)
    itemsize = _precision(r, out)
    _optimizer(r, out)
    for ds_key, key in (
        ("zero_optimization.sub_group_size", "sub_group_size"),
        ("zero_optimization.reduce_bucket_size", "reduce_bucket_size"),
        ("zero_optimization.stage3_param_persistence_threshold", "param_persistence_threshold"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    ):
        value = r.get(ds_key)
        if value is not None:
            out[key] = _number(ds_key, value)
    if out.get("reduce_bucket_size", 1) < 1:  # 0: DeepSpeed's smallest buckets
        out["reduce_bucket_size"] = 1
    prefetch = r.get("zero_optimization.stage3_prefetch_bucket_size")
    if prefetch is not None:  # DeepSpeed counts elements; prefetch_bytes counts bytes
        out["prefetch_bytes"] = (
            _number("zero_optimization.stage3_prefetch_bucket_size", prefetch) * itemsize
        )
    clip = r.get("gradient_clipping")
    if clip is not None:
        clip = _number("gradient_clipping", clip, float)
        out["max_grad_norm"] = clip if clip > 0 else None
    for path in _leaves(data):
        if path in r.seen or path.split(".")[0] in allow:
            continue
        reason = _IGNORED.get(path) or _IGNORED.get(path.split(".")[0])
        if reason is None:
            hint = (
                (
                    ": zero_offload does not run DeepSpeed's lr schedules; remove it and drive "
                    "engine.optimizer with a torch.optim.lr_scheduler (trainer integrations "
                    "use the trainer's own scheduler)"
                )
                if path.startswith("scheduler")
                else ": remove it (zero_offload has no equivalent)"
            )
            raise ConfigError(f"DeepSpeed config key {path!r} is not supported{hint}")
        log.info("DeepSpeed config key %r is not needed: %s", path, reason)
    return out
