"""Building a :class:`~.zero.ZeroConfig` from keywords, a dict or a JSON file (a DeepSpeed one
too), and the flat list of keywords it takes."""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import Field, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from ..activations.config import ActivationConfig
from ..deepspeed_config import is_deepspeed, keyword_autos, translate
from ..errors import ConfigError
from .checks import RENAMES
from .offload import OffloadConfig
from .optimizer import OptimizerConfig
from .precision import PrecisionConfig
from .zero import ZeroConfig

__all__ = [
    "SECTIONS",
    "build_config",
    "config_keys",
    "describe",
    "flat_keys",
    "keyword_fields",
    "load_config",
]

# Flat user-facing key -> (section attribute or None for top level, field name).
SECTIONS = {
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "offload": OffloadConfig,
    "activations": ActivationConfig,
}


def flat_keys() -> dict[str, tuple[str | None, str]]:
    keys: dict[str, tuple[str | None, str]] = {
        f.name: (None, f.name) for f in fields(ZeroConfig) if f.name not in SECTIONS
    }
    renamed = {target: key for key, target in RENAMES.items()}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            keys[renamed.get((section, f.name), f.name)] = (section, f.name)
    return keys


def config_keys() -> list[str]:
    """Every keyword ``initialize`` accepts."""
    return sorted(flat_keys())


def keyword_fields() -> list[tuple[str, type, Field[Any]]]:
    """Every keyword with the dataclass that declares it and its field, in declaration order
    (the top level first): what ``zero-offload keywords`` writes the reference from."""
    out = []
    for key, (section, name) in flat_keys().items():
        cls: type = SECTIONS[section] if section else ZeroConfig
        out.append((key, cls, next(f for f in fields(cls) if f.name == name)))
    return out


def load_config(config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """The ``config=`` argument as a dict: a mapping as it is, a JSON file read."""
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
    loaded = load_config(config)
    if is_deepspeed(loaded):  # its "auto" values: what the keywords say
        loaded = translate(loaded, keyword_autos(kwargs))
    values = {**loaded, **kwargs}
    keys = flat_keys()
    unknown = [k for k in values if k not in keys]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(keys), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown keyword {key!r}{hint}; valid keywords: {', '.join(sorted(keys))}"
        )
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        section, name = keys[key]
        (sections[section] if section else top)[name] = value
    try:
        built = {name: cls(**sections[name]) for name, cls in SECTIONS.items()}
        return ZeroConfig(**top, **built)
    except TypeError as exc:  # a value of a type the dataclass cannot even hold
        raise ConfigError(str(exc)) from exc


def describe(cfg: ZeroConfig) -> dict[str, Any]:
    """A JSON-friendly flat view of the config, e.g. for logs and checkpoint manifests."""
    out: dict[str, Any] = {}
    for key, (section, name) in flat_keys().items():
        value = getattr(getattr(cfg, section) if section else cfg, name)
        if key == "process_group":
            continue
        out[key] = str(value) if isinstance(value, (torch.dtype, torch.device)) else value
    return out
