"""The offload section: where the optimizer state and stage 3's parameter shards live, the
host-memory budget, and the splits between host memory and NVMe."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError
from ..fields import keyword
from ..policies import OFFLOAD_KEYWORDS, Tier
from .checks import bad, number, whole_numbers

__all__ = ["OFFLOAD_TARGETS", "OffloadConfig"]

OFFLOAD_TARGETS = OFFLOAD_KEYWORDS


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
        "to 1; the other sub-groups of each rank's shard keep their fp32 master and moments "
        "in host memory, spread between those in files, and are stepped while the next file "
        'is read. "auto": as much in host '
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
        whole_numbers(self)
        for key, value in (("offload_optimizer", self.optimizer), ("offload_param", self.param)):
            if value is None:
                value = "none"
            if value not in OFFLOAD_TARGETS:
                raise bad(key, value, "expected 'none', 'cpu' or 'nvme'")
        object.__setattr__(self, "optimizer", self.optimizer or "none")
        object.__setattr__(self, "param", self.param or "none")
        uses_nvme = "nvme" in (self.optimizer, self.param)
        if uses_nvme and not self.nvme_path:
            raise ConfigError(
                "offload to 'nvme' needs nvme_path: pass nvme_path='/path/on/a/fast/disk'"
            )
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)):
                raise bad("nvme_path", self.nvme_path, "expected a directory path")
            object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))
        if self.host_memory_limit is not None:
            number("host_memory_limit", self.host_memory_limit, lo=1, integer=True)
        number("sub_group_size", self.sub_group_size, lo=1, integer=True)
        self._check_fraction()

    def _check_fraction(self) -> None:
        if self.param_fraction is not None:
            value = number("offload_param_fraction", self.param_fraction, lo=0.0, hi=1.0)
            if value != value:
                raise bad("offload_param_fraction", value, "expected a number in [0, 1]")
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
                raise bad(
                    "offload_optimizer_fraction",
                    fraction,
                    "expected a number in [0, 1] (the share on NVMe) or 'auto'",
                )
            fraction = number("offload_optimizer_fraction", fraction, lo=0.0, hi=1.0)
            if fraction != fraction:  # nan passes both bounds
                raise bad("offload_optimizer_fraction", fraction, "expected a number in [0, 1]")
            object.__setattr__(self, "optimizer_fraction", fraction)
        if self.optimizer != "nvme":
            raise ConfigError(
                f"offload_optimizer_fraction={fraction!r} splits the optimizer state between host "
                f"memory and NVMe, so it needs offload_optimizer='nvme' (got "
                f"{self.optimizer!r}); set offload_optimizer='nvme' and nvme_path, or drop "
                "offload_optimizer_fraction"
            )

    @property
    def optimizer_tier(self) -> Tier:
        """Where the fp32 master and the optimizer's moments live, parsed from
        ``offload_optimizer``."""
        return Tier.from_keyword(self.optimizer)

    @property
    def param_tier(self) -> Tier:
        """Where stage 3's parameter shards live between uses, parsed from ``offload_param``."""
        return Tier.from_keyword(self.param)

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
