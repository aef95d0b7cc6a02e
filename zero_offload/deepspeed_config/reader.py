"""Reading a DeepSpeed config as DeepSpeed does: a key by any of its names, ``"auto"`` and
absent keys resolved to the value DeepSpeed would use, numbers and flags checked with the
key's name in the error."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping

from ..errors import ConfigError
from .table import VALIDATED, find

__all__ = [
    "ABSENT",
    "AUTO",
    "BY_KEYWORD",
    "DTYPE_NAMES",
    "Reader",
    "canonical",
    "flag",
    "number",
    "world_size",
]

log = logging.getLogger(__name__)

AUTO = "auto"
ABSENT = object()
DTYPE_NAMES = {
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
BY_KEYWORD = {
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "eps": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_grad_norm": "gradient_clipping",
}


def world_size() -> int:
    """The data-parallel world size a config is read for: the process group's, else
    ``WORLD_SIZE`` (set by torchrun before the group exists), else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def canonical(path: str) -> str:
    key = find(path)
    if key is not None and path in key.aliases:
        return key.path
    return path


class Reader:
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
        self.resolve = {canonical(k): v for k, v in resolve.items()}
        self.defaults = {canonical(k): v for k, v in defaults.items()}
        self.trainer = trainer
        self.seen: set[str] = set()

    def _raw(self, path: str) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return ABSENT
            node = node[part]
        return node

    def get(self, path: str, default: Any = None) -> Any:
        """The value of ``path`` (a canonical key of the table, or a section), ``default``
        when absent (a trainer's own default, from ``defaults``, comes first)."""
        key = find(path)
        names = [path] + list(key.aliases if key is not None and key.path == path else ())
        found = [(n, v) for n in names if (v := self._raw(n)) is not ABSENT]
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
            keyword = {p: k for k, p in BY_KEYWORD.items()}.get(path)
            keyword = keyword or ("dtype" if path in ("fp16.enabled", "bf16.enabled") else None)
            fix = "give it a value" + (f", or pass {keyword}= to initialize" if keyword else "")
        raise ConfigError(f'DeepSpeed config key {name!r} is "auto": {fix}')

    def section(self, name: str) -> Mapping[str, Any]:
        value = self._raw(name)
        return value if isinstance(value, Mapping) else {}


def number(path: str, value: Any, cast: Callable[[float], Any] = int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"DeepSpeed config key {path!r}={value!r}: expected a number")
    return cast(value)


def flag(path: str, value: Any) -> bool:
    if value not in (True, False):  # as DeepSpeed's config models: 0 and 1 too
        raise ConfigError(f"DeepSpeed config key {path!r}={value!r}: expected true or false")
    return bool(value)
