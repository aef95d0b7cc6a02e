"""DeepSpeed JSON configs, translated to zero_offload keywords.

People arrive with a DeepSpeed config from a recipe repository. :func:`translate` turns it
into :func:`zero_offload.initialize` keywords following the decision table of
:mod:`.table`: translated keys become keywords, accepted ones are logged once
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
from typing import Any, Mapping

from ..errors import ConfigError
from .reader import AUTO, BY_KEYWORD, DTYPE_NAMES, Reader, number, world_size
from .sections import (
    read_batch,
    read_grad_accum_dtype,
    read_optimizer,
    read_precision,
    read_zero,
)
from .table import KEYS, VALIDATED, Decision, Key, find

__all__ = ["is_deepspeed", "keyword_autos", "translate", "world_size", "AUTO"]

log = logging.getLogger(__name__)


# Top-level keys that only exist in DeepSpeed's format (gradient_accumulation_steps is a
# keyword of initialize too): their presence marks a dict as one.
_MARKERS = {n.split(".")[0] for k in KEYS for n in (k.path, *k.aliases)} - {
    "gradient_accumulation_steps"
}


def keyword_autos(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """What ``initialize`` keywords say for a DeepSpeed config's "auto" values: the same
    setting (``lr`` for ``optimizer.params.lr``, ``dtype`` for ``fp16/bf16.enabled``, ...);
    the batch sizes are the data loader's, so "auto" ones are left unset."""
    out: dict[str, Any] = {"train_batch_size": None, "train_micro_batch_size_per_gpu": None}
    for name, path in BY_KEYWORD.items():
        if name in keywords:
            value = keywords[name]
            out[path] = (value or 0.0) if name == "max_grad_norm" else value
    if "dtype" in keywords:
        name = str(keywords["dtype"]).removeprefix("torch.")
        out["fp16.enabled"] = DTYPE_NAMES.get(name) == "float16"
        out["bf16.enabled"] = DTYPE_NAMES.get(name) == "bfloat16"
    return out


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """True when ``data`` is in DeepSpeed's format rather than zero_offload's flat keywords."""
    return any(k in _MARKERS for k in data)


def _leaves(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key of ``data``, down to a value or to a section the table decides whole
    (a section nobody knows, too: DeepSpeed ignores an unknown top-level key whole)."""
    out = []
    for name, value in data.items():
        path = f"{prefix}{name}"
        if isinstance(value, Mapping) and path in _PREFIXES:
            out.extend(_leaves(value, path + "."))  # an empty section holds no key
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


def _decide(r: Reader, data: Mapping[str, Any], handled: tuple[str, ...]) -> None:
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
    itself, see :mod:`.schedules`); ``defaults``: its values for absent keys where they differ
    from DeepSpeed's own; ``world``: the data-parallel world size
    (default :func:`world_size`)."""
    r = Reader(data, resolve or {}, defaults or {}, trainer)
    out: dict[str, Any] = {}
    itemsize = read_precision(r, out)
    read_zero(r, out, itemsize)
    read_optimizer(r, out)
    read_batch(r, out, world if world is not None else world_size())
    read_grad_accum_dtype(r, out)
    clip = number("gradient_clipping", r.get("gradient_clipping", 1.0), float)
    out["max_grad_norm"] = clip if clip > 0 else None
    if "scheduler" in data and trainer is None:  # the engine runs it (trainers: their own)
        section = data["scheduler"]
        if not isinstance(section, Mapping):
            raise ConfigError(f"DeepSpeed config key 'scheduler'={section!r}: expected a section")
        out["lr_schedule"] = dict(section)
    _decide(r, data, ("scheduler",))
    return out
