"""The activation keywords: which saved tensors go to host memory, and the tiled loss.

A section of :class:`zero_offload.config.ZeroConfig` (``config.activations``), in its own
module beside the code it configures; it imports nothing of the package but the error type,
so ``config`` can hold it without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..fields import keyword

__all__ = ["ActivationConfig", "MODES", "DEFAULT_MIN_BYTES", "DEFAULT_TILE_TOKENS"]

MODES = ("none", "checkpoints", "all")
"""``offload_activations``: nothing; the inputs activation checkpointing keeps at each
checkpointed region (``True``); every saved tensor of the forward."""

DEFAULT_MIN_BYTES = 1 << 20
"""Saved tensors smaller than this stay on the device: their copies cost more than they free."""

DEFAULT_TILE_TOKENS = 4096
"""Tokens per tile of the tiled loss with ``tiled_loss=True``."""


def _whole(key: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} is not valid: expected an integer >= {lo}")
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{key}={value!r} is not valid: expected an integer >= {lo}")
    if value < lo:
        raise ConfigError(f"{key}={value!r} is not valid: expected an integer >= {lo}")
    return int(value)


@dataclass(frozen=True)
class ActivationConfig:
    """Activation offload (saved tensors to host buffers during forward, back ahead of use
    during backward) and the tiled loss (LM head + cross-entropy in tiles of the sequence)."""

    # key: offload_activations
    mode: str = keyword(
        "none",
        '"checkpoints" (or True): the inputs activation checkpointing keeps go to host memory '
        'during forward and come back ahead of use in backward; "all": every saved tensor; '
        '"none" (or False): nothing',
    )
    # key: offload_activations_min_bytes
    min_bytes: int = keyword(
        DEFAULT_MIN_BYTES,
        "saved tensors smaller than this stay on the device",
        shown="1 MiB",
    )
    # key: offload_activations_prefetch
    prefetch: int = keyword(
        2,
        "copies in flight each way (device-to-host in forward, inputs brought back ahead in "
        "backward)",
    )
    tiled_loss: int = keyword(
        0,
        "tokens per tile of the tiled loss (True: 4096), used by `ZeroOffloadTrainer` for causal "
        "LMs; 0: the plain loss (the engine itself computes no loss)",
    )

    def __post_init__(self) -> None:
        mode = self.mode
        if mode is True:
            mode = "checkpoints"
        elif mode is False or mode is None:
            mode = "none"
        if mode not in MODES:
            raise ConfigError(
                f"offload_activations={self.mode!r} is not valid: expected 'none', "
                "'checkpoints' (or True: the inputs kept at activation-checkpoint boundaries) "
                "or 'all' (every saved tensor)"
            )
        object.__setattr__(self, "mode", mode)
        object.__setattr__(
            self, "min_bytes", _whole("offload_activations_min_bytes", self.min_bytes, 0)
        )
        object.__setattr__(
            self, "prefetch", _whole("offload_activations_prefetch", self.prefetch, 1)
        )
        tiles = self.tiled_loss
        if tiles is True:
            tiles = DEFAULT_TILE_TOKENS
        elif tiles is False or tiles is None:
            tiles = 0
        object.__setattr__(self, "tiled_loss", _whole("tiled_loss", tiles, 0))

    @property
    def offload(self) -> bool:
        return self.mode != "none"
