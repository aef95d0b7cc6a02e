"""DeepSpeed JSON configs, translated to zero_offload keywords.

People arrive with a DeepSpeed config from a recipe repository. :func:`translate` turns it
into :func:`zero_offload.initialize` keywords following the decision table of
:mod:`zero_offload.ds_keys`: translated keys become keywords, accepted ones are logged once
with the reason they are not needed, refused ones (they would change training in a way this
library cannot honour) are a :class:`ConfigError` naming the key and the fix.

It reads a config as DeepSpeed does: DeepSpeed's other names for a key (aliases) mean the
same; ``"auto"`` is what a trainer fills in (``resolve``), or DeepSpeed's default inside the
sections DeepSpeed validates, and an error elsewhere; an absent key takes DeepSpeed's
default where that default changes training (``gradient_clipping`` 1.0, ``fp16.hysteresis``
2, ...); a top-level key DeepSpeed does not read is ignored, as DeepSpeed ignores it (with a
warning, and the closest known key), while an unknown key inside a validated section is an
error in both.
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Any, Callable, Mapping

from .ds_keys import KEYS, VALIDATED, Decision, Key, find
from .errors import ConfigError

__all__ = ["is_deepspeed", "keyword_autos", "translate", "world_size", "AUTO"]

log = logging.getLogger(__name__)

AUTO = "auto"

# Top-level keys that only exist in DeepSpeed's format (gradient_accumulation_steps is a
# keyword of initialize too): their presence marks a dict as one.
_MARKERS = {n.split(".")[0] for k in KEYS for n in (k.path, *k.aliases)} - {
    "gradient_accumulation_steps"
}
_ABSENT = object()
_DTYPE_NAMES = {
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


# "auto" keys that an initialize() keyword of the same meaning fills in
_BY_KEYWORD = {
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "eps": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_grad_norm": "gradient_clipping",
}


def keyword_autos(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """What ``initialize`` keywords say for a DeepSpeed config's "auto" values: the same
    setting (``lr`` for ``optimizer.params.lr``, ``dtype`` for ``fp16/bf16.enabled``, ...);
    the batch sizes are the data loader's, so "auto" ones are left unset."""
    out: dict[str, Any] = {"train_batch_size": None, "train_micro_batch_size_per_gpu": None}
    for name, path in _BY_KEYWORD.items():
        if name in keywords:
            value = keywords[name]
            out[path] = (value or 0.0) if name == "max_grad_norm" else value
    if "dtype" in keywords:
        name = str(keywords["dtype"]).removeprefix("torch.")
        out["fp16.enabled"] = _DTYPE_NAMES.get(name) == "float16"
        out["bf16.enabled"] = _DTYPE_NAMES.get(name) == "bfloat16"
    return out


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """True when ``data`` is in DeepSpeed's format rather than zero_offload's flat keywords."""
    return any(k in _MARKERS for k in data)


def world_size() -> int:
    """The data-parallel world size a config is read for: the process group's, else
    ``WORLD_SIZE`` (set by torchrun before the group exists), else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def _canonical(path: str) -> str:
    key = find(path)
    if key is not None and path in key.aliases:
        return key.path
    return path


class _Reader:
    """Walks the config: values by canonical key (aliases folded in), ``"auto"`` resolved,
    and which dotted keys were used."""

    def __init__(
        self,
        data: Mapping[str, Any],
        resolve: Mapping[str, Any],
        defaults: Mapping[str, Any],
        trainer: str | None,
    ) -> None:
        self.data = data
        self.resolve = {_canonical(k): v for k, v in resolve.items()}
        self.defaults = {_canonical(k): v for k, v in defaults.items()}
        self.trainer = trainer
        self.seen: set[str] = set()

    def _raw(self, path: str) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return _ABSENT
            node = node[part]
        return node

    def get(self, path: str, default: Any = None) -> Any:
        """The value of ``path`` (a canonical key of the table, or a section), ``default``
        when absent (a trainer's own default, from ``defaults``, comes first)."""
        key = find(path)
        names = [path] + list(key.aliases if key is not None and key.path == path else ())
        found = [(n, v) for n in names if (v := self._raw(n)) is not _ABSENT]
        self.seen.update(n for n, _ in found)
        if len({repr(v) for _, v in found}) > 1:
            given = ", ".join(f"{n}={v!r}" for n, v in found)
            raise ConfigError(
                f"DeepSpeed config gives one key under two of its names ({given}): keep one"
            )
        if not found:
            return self.defaults.get(path, default)
        name, value = found[0]
        if value != AUTO:
            return value
        if path in self.resolve:
            return self.resolve[path]
        if name.split(".")[0] in VALIDATED:  # DeepSpeed's config models drop "auto"
            log.info('DeepSpeed config key %r is "auto": DeepSpeed\'s default applies', name)
            return self.defaults.get(path, default)
        if self.trainer:
            fix = f"{self.trainer} does not fill it in: give it a value"
        else:
            keyword = {p: k for k, p in _BY_KEYWORD.items()}.get(path)
            keyword = keyword or ("dtype" if path in ("fp16.enabled", "bf16.enabled") else None)
            fix = "give it a value" + (f", or pass {keyword}= to initialize" if keyword else "")
        raise ConfigError(f'DeepSpeed config key {name!r} is "auto": {fix}')

    def section(self, name: str) -> Mapping[str, Any]:
        value = self._raw(name)
        return value if isinstance(value, Mapping) else {}


def _number(path: str, value: Any, cast: Callable[[float], Any] = int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"DeepSpeed config key {path!r}={value!r}: expected a number")
    return cast(value)


def _flag(path: str, value: Any) -> bool:
    if value not in (True, False):  # as DeepSpeed's config models: 0 and 1 too
        raise ConfigError(f"DeepSpeed config key {path!r}={value!r}: expected true or false")
    return bool(value)


def _leaves(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key of ``data``, down to a value or to a section the table decides whole
    (a section nobody knows, too: DeepSpeed ignores an unknown top-level key whole)."""
    out = []
    for name, value in data.items():
        path = f"{prefix}{name}"
        if isinstance(value, Mapping) and value and path in _PREFIXES:
            out.extend(_leaves(value, path + "."))
        else:
            out.append(path)
    return out


# every proper dotted prefix of a key of the table: the sections it decides key by key
_PREFIXES = {
    ".".join(parts[:n])
    for k in KEYS
    for name in (k.path, *k.aliases)
    for parts in [name.split(".")]
    for n in range(1, len(parts))
}


# -- the translation ------------------------------------------------------------------------


def _offload(r: _Reader, section: str, out: dict[str, Any]) -> None:
    path = f"zero_optimization.{section}.device"
    device = r.get(path, "none")
    if device not in ("none", "cpu", "nvme", None):
        raise ConfigError(f"DeepSpeed config key {path!r}={device!r}: expected none, cpu or nvme")
    legacy = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}[section]
    if _flag(f"zero_optimization.{legacy}", r.get(f"zero_optimization.{legacy}", False)):
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


def _enabled(r: _Reader, section: str) -> bool:
    return _flag(f"{section}.enabled", r.get(f"{section}.enabled", False))


def _precision(r: _Reader, out: dict[str, Any]) -> int:
    """Compute dtype and loss-scale keys; returns the dtype's size in bytes."""
    fp16, bf16 = _enabled(r, "fp16"), _enabled(r, "bf16")
    if fp16 and bf16:
        raise ConfigError("DeepSpeed config enables both 'fp16' and 'bf16': choose one")
    if bf16:
        out["dtype"] = "bfloat16"
        check = r.get("bf16.check_grad_overflow", True)
        out["skip_nonfinite_steps"] = _flag("bf16.check_grad_overflow", check)
    if not fp16:
        return 2 if bf16 else 4
    out["dtype"] = "float16"
    static = r.get("fp16.loss_scale", 0)
    if static not in (0, None):
        raise ConfigError(
            f"DeepSpeed config key 'fp16.loss_scale'={static!r}: zero_offload scales the loss "
            "dynamically only; set it to 0"
        )
    power = _number("fp16.initial_scale_power", r.get("fp16.initial_scale_power", 16))
    out["initial_loss_scale"] = 2.0**power
    window = r.get("fp16.loss_scale_window", 1000)
    out["loss_scale_window"] = _number("fp16.loss_scale_window", window)
    out["min_loss_scale"] = _number("fp16.min_loss_scale", r.get("fp16.min_loss_scale", 1), float)
    out["loss_scale_hysteresis"] = _number("fp16.hysteresis", r.get("fp16.hysteresis", 2))
    consecutive = r.get("fp16.consecutive_hysteresis", False)
    out["consecutive_hysteresis"] = _flag("fp16.consecutive_hysteresis", consecutive)
    return 2


def _optimizer(r: _Reader, out: dict[str, Any]) -> None:
    if not r.section("optimizer"):
        return
    kind = str(r.get("optimizer.type", "AdamW"))
    adamw = _flag("optimizer.params.adam_w_mode", r.get("optimizer.params.adam_w_mode", True))
    if kind.lower() not in ("adam", "adamw") or (kind.lower() == "adam" and not adamw):
        raise ConfigError(
            f"DeepSpeed config key 'optimizer.type'={kind!r}"
            + (", adam_w_mode=false" if kind.lower() == "adam" else "")
            + ": zero_offload runs AdamW (decoupled weight decay); use type 'AdamW'"
        )
    torch_adam = _flag("optimizer.params.torch_adam", r.get("optimizer.params.torch_adam", False))
    defaults = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.01 if torch_adam else 0.0}
    for name, default in defaults.items():
        path = f"optimizer.params.{name}"
        out[name] = _number(path, r.get(path, default), float)
    betas = r.get("optimizer.params.betas", (0.9, 0.999))
    if not isinstance(betas, (list, tuple)):
        raise ConfigError(
            f"DeepSpeed config key 'optimizer.params.betas'={betas!r}: expected two numbers"
        )
    out["betas"] = tuple(betas)


def _batch(r: _Reader, out: dict[str, Any], world: int) -> None:
    """gradient_accumulation_steps from the three batch keys, as DeepSpeed derives it."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train, micro, gas = (None if (v := r.get(k)) is None else _number(k, v) for k in keys)
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


def _grad_accum_dtype(r: _Reader, out: dict[str, Any]) -> None:
    value = r.get("data_types.grad_accum_dtype")
    if value is None:
        return
    want = _DTYPE_NAMES.get(str(value).removeprefix("torch."))
    dtype = out.get("dtype", "float32")
    ours = "float32" if out.get("offload_optimizer", "none") != "none" else dtype
    if want != ours:
        raise ConfigError(
            f"DeepSpeed config key 'data_types.grad_accum_dtype'={value!r}: zero_offload "
            f"accumulates these gradients in {ours} (fp32 when the optimizer is offloaded, else "
            "the compute dtype); remove the key, or offload the optimizer to accumulate in fp32"
        )


def _zero(r: _Reader, out: dict[str, Any], itemsize: int) -> None:
    zero = r._raw("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's oldest form: true is stage 1
        r.seen.add("zero_optimization")
        out["stage"] = int(zero)
    else:
        out["stage"] = _number("zero_optimization.stage", r.get("zero_optimization.stage", 0))
    for section in ("offload_optimizer", "offload_param"):
        _offload(r, section, out)
    sub = r.get("zero_optimization.sub_group_size")
    if sub is not None and _number("zero_optimization.sub_group_size", sub) > 0:
        out["sub_group_size"] = int(sub)  # 0: one parameter per sub-group in DeepSpeed
    bucket = r.get("zero_optimization.reduce_bucket_size")
    if bucket is not None:  # 0: DeepSpeed's smallest buckets
        out["reduce_bucket_size"] = max(1, _number("zero_optimization.reduce_bucket_size", bucket))
    keep = r.get("zero_optimization.param_persistence_threshold")
    if keep is not None:
        out["param_persistence_threshold"] = _number("stage3_param_persistence_threshold", keep)
    prefetch = r.get("zero_optimization.prefetch_bucket_size")
    if prefetch is not None:  # DeepSpeed counts elements; prefetch_bytes counts bytes
        out["prefetch_bytes"] = _number("stage3_prefetch_bucket_size", prefetch) * itemsize


def _decide(r: _Reader, data: Mapping[str, Any], handled: tuple[str, ...]) -> None:
    """Every key the translation did not use: accepted (logged), refused, or unknown."""
    sections_done: set[str] = set()
    for path in _leaves(data):
        if path in r.seen or path.split(".")[0] in handled:
            continue
        key = find(path)
        if key is None:
            _unknown(path)
            continue
        if key.decision is Decision.TRANSLATED:
            top = path.split(".")[0]
            if top in ("fp16", "bf16", "bfloat16"):
                continue  # off with its section: fp16 off, its loss-scale keys do nothing
            raise AssertionError(f"translated key {path!r} was not read")  # the table's promise
        name = next(n for n in (key.path, *key.aliases) if path == n or path.startswith(n + "."))
        if name in sections_done:
            continue
        sections_done.add(name)
        value = r._raw(name)
        if key.decision is Decision.ACCEPTED:
            log.info("DeepSpeed config key %r is not needed: %s", name, key.why)
        elif _is_off(key, value):
            log.info("DeepSpeed config key %r is off (%r): nothing to do", name, value)
        else:
            fix = (
                f"remove it or set it to {' or '.join(repr(v) for v in key.off)}"
                if key.off
                else "remove it" + (" or set its 'enabled' to false" if _gated(value) else "")
            )
            raise ConfigError(
                f"DeepSpeed config key {name!r}={value!r} is not supported: {key.why}; {fix}"
            )


def _gated(value: Any) -> bool:
    return isinstance(value, Mapping) and "enabled" in str(value)


def _is_off(key: Key, value: Any) -> bool:
    if key.off:
        return value in key.off
    flags = _flags(value)
    return bool(flags) and not any(flags)


def _flags(value: Any) -> list[bool]:
    """Every ``enabled`` inside a section, however deep."""
    if not isinstance(value, Mapping):
        return []
    out = [bool(v) for k, v in value.items() if k == "enabled"]
    for v in value.values():
        out.extend(_flags(v))
    return out


def _unknown(path: str) -> None:
    top = path.split(".")[0]
    known = [n for k in KEYS for n in (k.path, *k.aliases)]
    close = difflib.get_close_matches(path, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    if "." not in path:
        if not path.startswith("_"):  # "_comment" keys
            log.warning(
                "DeepSpeed config key %r is not one DeepSpeed reads: ignored, as DeepSpeed "
                "ignores it%s",
                path,
                hint,
            )
        return
    where = (
        "DeepSpeed's config model refuses it too"
        if top in VALIDATED
        else "DeepSpeed would pass it on and fail"
    )
    raise ConfigError(f"DeepSpeed config key {path!r} is not a DeepSpeed key{hint}: {where}")


def translate(
    data: Mapping[str, Any],
    resolve: Mapping[str, Any] | None = None,
    *,
    trainer: str | None = None,
    defaults: Mapping[str, Any] | None = None,
    world: int | None = None,
) -> dict[str, Any]:
    """The :func:`zero_offload.initialize` keywords equivalent to DeepSpeed config ``data``.

    ``trainer``: the integration reading it (it fills ``"auto"`` values from ``resolve``, by
    dotted key, e.g. ``{"optimizer.params.lr": 5e-5}``, and runs the ``scheduler`` section
    itself, see :mod:`zero_offload.ds_schedules`); ``defaults``: its values for absent keys
    where they differ from DeepSpeed's own; ``world``: the data-parallel world size
    (default :func:`world_size`)."""
    r = _Reader(data, resolve or {}, defaults or {}, trainer)
    out: dict[str, Any] = {}
    itemsize = _precision(r, out)
    _zero(r, out, itemsize)
    _optimizer(r, out)
    _batch(r, out, world if world is not None else world_size())
    _grad_accum_dtype(r, out)
    clip = _number("gradient_clipping", r.get("gradient_clipping", 1.0), float)
    out["max_grad_norm"] = clip if clip > 0 else None
    if "scheduler" in data and trainer is None:  # the engine runs it (trainers: their own)
        section = data["scheduler"]
        if not isinstance(section, Mapping):
            raise ConfigError(f"DeepSpeed config key 'scheduler'={section!r}: expected a section")
        out["lr_schedule"] = dict(section)
    _decide(r, data, ("scheduler",))
    return out
