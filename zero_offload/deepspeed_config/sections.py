"""The DeepSpeed sections whose keys become :func:`zero_offload.initialize` keywords: offload,
precision, the optimizer, the batch keys and ZeRO. Each reads its keys from a :class:`Reader`
and writes keywords into ``out``."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .reader import ABSENT, DTYPE_NAMES, Reader, flag, number

__all__ = [
    "enabled",
    "read_batch",
    "read_grad_accum_dtype",
    "read_offload",
    "read_optimizer",
    "read_precision",
    "read_zero",
]


def read_offload(r: Reader, section: str, out: dict[str, Any]) -> None:
    path = f"zero_optimization.{section}.device"
    device = r.get(path, "none")
    if device not in ("none", "cpu", "nvme", None):
        raise ConfigError(f"DeepSpeed config key {path!r}={device!r}: expected none, cpu or nvme")
    legacy = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}[section]
    if flag(f"zero_optimization.{legacy}", r.get(f"zero_optimization.{legacy}", False)):
        if device not in ("none", None) and device != "cpu":
            raise ConfigError(
                f"DeepSpeed config: zero_optimization.{legacy}=true and {path}={device!r} "
                "disagree: keep one"
            )
        device = "cpu"
    out[section] = device or "none"
    nvme = r.get(f"zero_optimization.{section}.nvme_path")
    if nvme is not None and device == "nvme":
        if out.get("nvme_path", nvme) != nvme:
            raise ConfigError(
                "DeepSpeed config: offload_optimizer.nvme_path and offload_param.nvme_path "
                f"differ ({out['nvme_path']!r}, {nvme!r}); zero_offload keeps both tiers under "
                "one nvme_path: give both the same directory"
            )
        out["nvme_path"] = str(nvme)


def enabled(r: Reader, section: str) -> bool:
    return flag(f"{section}.enabled", r.get(f"{section}.enabled", False))


def read_precision(r: Reader, out: dict[str, Any]) -> int:
    """Compute dtype and loss-scale keys; returns the dtype's size in bytes."""
    fp16, bf16 = enabled(r, "fp16"), enabled(r, "bf16")
    if fp16 and bf16:
        raise ConfigError("DeepSpeed config enables both 'fp16' and 'bf16': choose one")
    if bf16:
        out["dtype"] = "bfloat16"
        check = r.get("bf16.check_grad_overflow", True)
        out["skip_nonfinite_steps"] = flag("bf16.check_grad_overflow", check)
    if not fp16:
        return 2 if bf16 else 4
    out["dtype"] = "float16"
    static = r.get("fp16.loss_scale", 0)
    if static not in (0, None):
        raise ConfigError(
            f"DeepSpeed config key 'fp16.loss_scale'={static!r}: zero_offload scales the loss "
            "dynamically only; set it to 0"
        )
    power = number("fp16.initial_scale_power", r.get("fp16.initial_scale_power", 16))
    out["initial_loss_scale"] = 2.0**power
    window = r.get("fp16.loss_scale_window", 1000)
    out["loss_scale_window"] = number("fp16.loss_scale_window", window)
    out["min_loss_scale"] = number("fp16.min_loss_scale", r.get("fp16.min_loss_scale", 1), float)
    out["loss_scale_hysteresis"] = number("fp16.hysteresis", r.get("fp16.hysteresis", 2))
    consecutive = r.get("fp16.consecutive_hysteresis", False)
    out["consecutive_hysteresis"] = flag("fp16.consecutive_hysteresis", consecutive)
    return 2


# DeepSpeed's optimizer types (it compares them lower-cased) that the engine steps, and the
# defaults of DeepSpeed's CPU classes for them (DeepSpeedCPUAdam, DeepSpeedCPULion,
# DeepSpeedCPUAdagrad) where a key is absent
_KINDS = {"adam": "adamw", "adamw": "adamw", "lion": "lion", "adagrad": "adagrad"}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "betas": (0.9, 0.999)},
    "lion": {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.999)},
    "adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
}


# keys DeepSpeed passes on to its Lion / Adagrad classes, whose constructors do not take them
_NOT_TAKEN = {
    "lion": ("eps", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad"),
    "adagrad": ("betas", "adam_w_mode", "torch_adam", "bias_correction"),
}


def read_optimizer(r: Reader, out: dict[str, Any]) -> None:
    """``optimizer.type`` Adam / AdamW (``adam_w_mode: false`` with type Adam: Adam with L2
    decay), Lion or Adagrad, with the hyperparameters DeepSpeed's own class for it would take
    (``torch_adam``: torch.optim.AdamW, weight decay 0.01 by default, or torch.optim.Adam, 0)."""
    if not r.section("optimizer"):
        return
    name = str(r.get("optimizer.type", "AdamW"))
    kind = _KINDS.get(name.lower())
    if kind is None:
        raise ConfigError(
            f"DeepSpeed config key 'optimizer.type'={name!r}: zero_offload steps Adam, AdamW, "
            "Lion and Adagrad; use one of those types"
        )
    defaults = dict(_DEFAULTS[kind])
    if kind == "adamw":  # types Adam and AdamW
        path = "optimizer.params.adam_w_mode"
        if not flag(path, r.get(path, True)) and name.lower() == "adam":
            kind = "adam"  # the weight decay is added to the gradient; type AdamW stays AdamW
        path = "optimizer.params.torch_adam"
        if flag(path, r.get(path, False)) and kind == "adamw":
            defaults["weight_decay"] = 0.01  # torch.optim.AdamW's default (torch.optim.Adam: 0)
    for key in _NOT_TAKEN.get(kind, ()):
        path = f"optimizer.params.{key}"
        if (value := r._raw(path)) is not ABSENT:
            raise ConfigError(
                f"DeepSpeed config key {path!r}={value!r}: DeepSpeed's {name} optimizer "
                f"takes no {key} (its constructor raises TypeError); remove the key"
            )
    if kind != "adamw":  # the default: the keywords of an AdamW config stay as they were
        out["optimizer_type"] = kind
    for key, default in defaults.items():
        path = f"optimizer.params.{key}"
        value = r.get(path, default)
        if key != "betas":
            out[key] = number(path, value, float)
        elif isinstance(value, (list, tuple)):
            out[key] = tuple(value)
        else:
            raise ConfigError(f"DeepSpeed config key {path!r}={value!r}: expected two numbers")


def read_batch(r: Reader, out: dict[str, Any], world: int) -> None:
    """gradient_accumulation_steps from the three batch keys, as DeepSpeed derives it."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train, micro, gas = (None if (v := r.get(k)) is None else number(k, v) for k in keys)
    if gas is None and train is not None:
        gas = max(1, train // micro // world) if micro is not None else 1
    if gas is not None:
        out["gradient_accumulation_steps"] = gas
    if train is not None:
        micro = micro if micro is not None else train // world // (gas or 1)
        if train != micro * (gas or 1) * world:
            raise ConfigError(
                f"DeepSpeed config: train_batch_size={train} is not train_micro_batch_size_per_gpu"
                f"={micro} x gradient_accumulation_steps={gas or 1} x world size {world}: fix "
                'one of them (or set them to "auto" under a trainer)'
            )


def read_grad_accum_dtype(r: Reader, out: dict[str, Any]) -> None:
    value = r.get("data_types.grad_accum_dtype")
    if value is None:
        return
    want = DTYPE_NAMES.get(str(value).removeprefix("torch."))
    dtype = out.get("dtype", "float32")
    ours = "float32" if out.get("offload_optimizer", "none") != "none" else dtype
    if want != ours:
        raise ConfigError(
            f"DeepSpeed config key 'data_types.grad_accum_dtype'={value!r}: zero_offload "
            f"accumulates these gradients in {ours} (fp32 when the optimizer is offloaded, else "
            "the compute dtype); remove the key, or offload the optimizer to accumulate in fp32"
        )


def read_zero(r: Reader, out: dict[str, Any], itemsize: int) -> None:
    zero = r._raw("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's oldest form: true is stage 1
        r.seen.add("zero_optimization")
        out["stage"] = int(zero)
    else:
        out["stage"] = number("zero_optimization.stage", r.get("zero_optimization.stage", 0))
    for section in ("offload_optimizer", "offload_param"):
        read_offload(r, section, out)
    sub = r.get("zero_optimization.sub_group_size")
    if sub is not None and number("zero_optimization.sub_group_size", sub) > 0:
        out["sub_group_size"] = int(sub)  # 0: one parameter per sub-group in DeepSpeed
    bucket = r.get("zero_optimization.reduce_bucket_size")
    if bucket is not None:  # 0: DeepSpeed's smallest buckets
        out["reduce_bucket_size"] = max(1, number("zero_optimization.reduce_bucket_size", bucket))
    keep = r.get("zero_optimization.param_persistence_threshold")
    if keep is not None:
        out["param_persistence_threshold"] = number("stage3_param_persistence_threshold", keep)
    prefetch = r.get("zero_optimization.prefetch_bucket_size")
    if prefetch is not None:  # DeepSpeed counts elements; prefetch_bytes counts bytes
        out["prefetch_bytes"] = number("stage3_prefetch_bucket_size", prefetch) * itemsize
