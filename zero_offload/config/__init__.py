"""Every knob of the engine, as one typed dataclass tree, validated up front.

Users pass flat keyword arguments (``initialize(model, stage=3, lr=1e-4, ...)``) or the same keys
as a dict or JSON file (``config=...``). Each flat key belongs to one section of the tree; the
sections keep related knobs together and keep ``Engine`` code from reaching into a bag of loose
values. A bad key or value raises :class:`ConfigError` naming the key, the value, what is allowed
and, for a misspelt key, the closest valid one.
"""

from __future__ import annotations

from ..activations.config import ActivationConfig
from ..errors import ConfigError
from .build import build_config, config_keys, describe, flat_keys, keyword_fields, load_config
from .checks import compute_dtype
from .offload import OffloadConfig
from .optimizer import OptimizerConfig
from .precision import PrecisionConfig
from .zero import ZeroConfig

__all__ = [
    "ActivationConfig",
    "ConfigError",
    "OffloadConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "ZeroConfig",
    "build_config",
    "compute_dtype",
    "config_keys",
    "describe",
    "flat_keys",
    "keyword_fields",
    "load_config",
]
