"""Where state lives and what a stage shards, as types: parsed once from the user's keywords
(``config/``, the DeepSpeed translation, the estimate's keywords), then asked, never compared
as strings or numbers again (``tests/test_policies_as_types.py`` counts).

This module imports nothing of the package, so every layer can use it.
"""

from __future__ import annotations

import enum

__all__ = ["OFFLOAD_KEYWORDS", "Stage", "Tier"]


class Tier(str, enum.Enum):
    """Storage tiers, fastest first. A ``str``: ``Tier.HOST == "host"``, so the ledger's
    ``bytes["host"]`` and printed tables read as before."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def from_keyword(cls, value: str) -> Tier:
        """``offload_optimizer`` / ``offload_param``'s value (``"none"``, ``"cpu"``,
        ``"nvme"``, already validated) as the tier it names."""
        return _BY_KEYWORD[value]

    @property
    def keyword(self) -> str:
        """The value of ``offload_optimizer`` / ``offload_param`` that names this tier."""
        return _KEYWORD[self]

    @property
    def offloaded(self) -> bool:
        """Off the compute device (host memory or files)."""
        return self is not Tier.DEVICE

    @property
    def on_host(self) -> bool:
        return self is Tier.HOST

    @property
    def on_nvme(self) -> bool:
        return self is Tier.NVME


_KEYWORD = {Tier.DEVICE: "none", Tier.HOST: "cpu", Tier.NVME: "nvme"}
_BY_KEYWORD = {v: k for k, v in _KEYWORD.items()}
OFFLOAD_KEYWORDS = tuple(_KEYWORD.values())  # "none", "cpu", "nvme": what the user writes


class Stage(enum.Enum):
    """What a ZeRO stage shards across the ranks, and what that asks of each part."""

    REPLICATED = 0  # data parallel: every rank holds everything
    OPTIMIZER = 1  # the optimizer state sharded
    GRADS = 2  # the gradients too
    PARAMS = 3  # the parameters too

    @property
    def number(self) -> int:
        """The stage's number, as the user wrote it and reports print it."""
        return int(self.value)

    @property
    def sharded(self) -> bool:
        """Some state is sharded across the ranks (stages 1-3), so each rank holds part of
        the gradients' reduction and of the update."""
        return self is not Stage.REPLICATED

    @property
    def shards_optimizer(self) -> bool:
        return self.sharded

    @property
    def shards_grads(self) -> bool:
        """Each rank keeps only its shard of the reduced gradients (stages 2-3): they are
        reduce-scattered unit by unit during backward."""
        return self in (Stage.GRADS, Stage.PARAMS)

    @property
    def shards_params(self) -> bool:
        """Each rank keeps only its shard of the parameters (stage 3): gathered to be used."""
        return self is Stage.PARAMS

    @property
    def reduces_during_backward(self) -> bool:
        return self.shards_grads

    @property
    def all_reduces(self) -> bool:
        """Gradients all-reduced whole (stage 0): every rank steps every parameter."""
        return self is Stage.REPLICATED
