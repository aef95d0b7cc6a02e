"""What the optimizer keeps per parameter: the update rule and the precision of each state.

Why a type: every part of the engine that sizes, stores, moves or steps optimizer state
(host buffers, NVMe files, checkpoints, the ledger, the planner) asks one
:class:`StatePolicy`, decided once from the config, instead of assuming 12 bytes a parameter.

Choices (config keywords ``optimizer_type``, ``moment_precision``, ``master_precision``):

- kind: ``adamw`` (default), ``adam`` (L2 weight decay), ``lion`` (one moment, sign update),
  ``adagrad`` (one accumulator of squared gradients, fp32 only: a growing sum stalls in
  fewer bits).
- moments: ``fp32`` (default), ``bf16`` (stochastically rounded, so slow averages such as
  Adam's v with beta2=0.999 keep moving), ``8bit`` (blockwise quantization with the dynamic
  maps of bitsandbytes' 8-bit optimizers: 256-element blocks from each parameter's first
  element, an fp32 absmax per block; tensors under 4096 elements keep fp32 moments).
- master: ``fp32`` (default), ``bf16_kahan`` (bf16 value + a bf16 compensation term: about
  16 significant bits, 4 bytes), ``bf16_sr`` (bf16 with stochastic rounding: 2 bytes,
  unbiased, seeded by step and element so results do not depend on the thread split).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, TypeVar

__all__ = [
    "ABSMAX_BYTES",
    "ADAM_STATE_BYTES",
    "BF16_BYTES",
    "BLOCK",
    "CODE_BYTES",
    "FP32_BYTES",
    "MIN_QUANTIZED_NUMEL",
    "MasterPrecision",
    "MomentPrecision",
    "OptimizerKind",
    "StatePolicy",
]

FP32_BYTES = 4
ADAM_STATE_BYTES = 3 * FP32_BYTES
"""fp32 AdamW's state per element: the master, ``exp_avg`` and ``exp_avg_sq`` (the default
policy's ``bytes_per_param``; the NVMe pipeline's files and buffers are sized by it)."""
BF16_BYTES = 2
CODE_BYTES = 1  # one 8-bit code per element of a quantized moment
ABSMAX_BYTES = 4  # one fp32 absmax per block of a quantized moment
BLOCK = 256  # elements per quantization block (bitsandbytes' blockwise optimizers)
_E = TypeVar("_E", bound=enum.Enum)
MIN_QUANTIZED_NUMEL = 4096  # smaller parameters keep fp32 moments (bitsandbytes' min_8bit_size)


class OptimizerKind(str, enum.Enum):
    """The update rule."""

    ADAMW = "adamw"
    ADAM = "adam"
    LION = "lion"
    ADAGRAD = "adagrad"

    @property
    def moment_names(self) -> tuple[str, ...]:
        """The per-element moments, named as the matching torch optimizer names its state."""
        if self in (OptimizerKind.ADAMW, OptimizerKind.ADAM):
            return ("exp_avg", "exp_avg_sq")
        if self is OptimizerKind.LION:
            return ("exp_avg",)
        return ("sum",)

    @property
    def signed_moments(self) -> tuple[bool, ...]:
        """Per moment: can it be negative (the signed 8-bit map) or not (the unsigned one)."""
        return tuple(name == "exp_avg" for name in self.moment_names)

    @property
    def decoupled_decay(self) -> bool:
        """Weight decay as ``p *= 1 - lr * wd`` (AdamW, Lion) rather than added to the grad."""
        return self in (OptimizerKind.ADAMW, OptimizerKind.LION)

    @property
    def default_betas(self) -> tuple[float, float]:
        """What ``betas`` means when not given: torch's AdamW, Lion's paper; unused by Adagrad."""
        return (0.9, 0.99) if self is OptimizerKind.LION else (0.9, 0.999)

    @property
    def default_eps(self) -> float:
        """torch's default for the matching optimizer (Lion has no eps)."""
        return 1e-10 if self is OptimizerKind.ADAGRAD else 1e-8


class MomentPrecision(str, enum.Enum):
    """How each moment element is stored."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "8bit"

    @property
    def element_bytes(self) -> int:
        """Bytes per element of a moment tensor (8-bit: the code; absmax comes per block)."""
        return {"fp32": FP32_BYTES, "bf16": BF16_BYTES, "8bit": CODE_BYTES}[self.value]


class MasterPrecision(str, enum.Enum):
    """How the optimizer's copy of the parameters is stored."""

    FP32 = "fp32"
    BF16_KAHAN = "bf16_kahan"
    BF16_SR = "bf16_sr"

    @property
    def element_bytes(self) -> int:
        return FP32_BYTES if self is MasterPrecision.FP32 else BF16_BYTES

    @property
    def compensation_bytes(self) -> int:
        """Bytes per element of the Kahan compensation term (0 when there is none)."""
        return BF16_BYTES if self is MasterPrecision.BF16_KAHAN else 0


def _parse(enum_type: type[_E], value: object, key: str) -> _E:
    if isinstance(value, enum_type):
        return value
    allowed = ", ".join(repr(m.value) for m in enum_type)
    if isinstance(value, str):
        text = value.strip().lower().replace("-", "_")
        for member in enum_type:
            if text == member.value or (text, member.value) in _ALIASES:
                return member
    raise ValueError(f"{key}={value!r} is not valid: expected one of {allowed}")


# other spellings users arrive with (HF optim names, dtype names)
_ALIASES = {
    ("int8", "8bit"),
    ("8_bit", "8bit"),
    ("float32", "fp32"),
    ("bfloat16", "bf16"),
    ("kahan", "bf16_kahan"),
    ("bf16kahan", "bf16_kahan"),
    ("stochastic", "bf16_sr"),
}


@dataclass(frozen=True)
class StatePolicy:
    """The optimizer's kind and state precisions. Defaults: fp32 AdamW (``ADAM_STATE_BYTES``)."""

    kind: OptimizerKind = OptimizerKind.ADAMW
    moments: MomentPrecision = MomentPrecision.FP32
    master: MasterPrecision = MasterPrecision.FP32
    fp32_moments: frozenset[str] = frozenset()
    """Parameters whose moments stay fp32 under 8-bit moments: bitsandbytes' per-parameter
    ``optim_bits=32`` override, which Hugging Face Trainer sets for every ``nn.Embedding``
    (rows without gradient in a step would otherwise take an m / eps jump). Empty for the
    other precisions."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _parse(OptimizerKind, self.kind, "optimizer_type"))
        object.__setattr__(
            self, "moments", _parse(MomentPrecision, self.moments, "moment_precision")
        )
        object.__setattr__(self, "master", _parse(MasterPrecision, self.master, "master_precision"))
        keep = frozenset(self.fp32_moments) if self.moments is MomentPrecision.INT8 else ()
        object.__setattr__(self, "fp32_moments", frozenset(keep))
        if self.kind is OptimizerKind.ADAGRAD and self.moments is not MomentPrecision.FP32:
            raise ValueError(
                f"moment_precision={self.moments.value!r} is not offered for Adagrad: its "
                "accumulator only grows, and a growing sum in fewer bits stops moving; use "
                "moment_precision='fp32' (or optimizer_type='adamw' / 'lion')"
            )

    @classmethod
    def parse(
        cls, kind: str, moments: str, master: str, fp32_moments: Iterable[str] = ()
    ) -> "StatePolicy":
        """From the config keywords' values (names as documented, a few aliases such as
        ``int8``); a ValueError names the keyword and what it takes."""
        return cls(
            _parse(OptimizerKind, kind, "optimizer_type"),
            _parse(MomentPrecision, moments, "moment_precision"),
            _parse(MasterPrecision, master, "master_precision"),
            frozenset(fp32_moments),
        )

    @property
    def moment_names(self) -> tuple[str, ...]:
        return self.kind.moment_names

    @property
    def num_moments(self) -> int:
        return len(self.kind.moment_names)

    @property
    def quantized(self) -> bool:
        return self.moments is MomentPrecision.INT8

    @property
    def is_default(self) -> bool:
        return self == StatePolicy()

    def moment_bytes(self, numel: int, blocks: int = 0, unquantized: int = 0) -> int:
        """Bytes of one moment over ``numel`` elements, of which ``unquantized`` keep fp32
        (8-bit only), spanning ``blocks`` quantization blocks."""
        if not self.quantized:
            return numel * self.moments.element_bytes
        return numel * CODE_BYTES + unquantized * FP32_BYTES + blocks * ABSMAX_BYTES

    def master_bytes(self, numel: int) -> int:
        """Bytes of the master (and its compensation term) over ``numel`` elements."""
        return numel * (self.master.element_bytes + self.master.compensation_bytes)

    @property
    def bytes_per_param(self) -> float:
        """State bytes per element of a large parameter (absmax amortized over its block):
        what planners multiply by a parameter count. Exact sizes of a shard come from
        :class:`~zero_offload.optim.layout.StateLayout`."""
        per_moment = (
            CODE_BYTES + ABSMAX_BYTES / BLOCK if self.quantized else self.moments.element_bytes
        )
        return (
            self.master.element_bytes
            + self.master.compensation_bytes
            + (self.num_moments * per_moment)
        )

    def describe(self) -> str:
        """One line for logs and tables, e.g. ``adamw, 8bit moments, bf16_sr master``."""
        kept = f", fp32 moments for {len(self.fp32_moments)} parameters" * bool(self.fp32_moments)
        return (
            f"{self.kind.value}, {self.moments.value} moments, {self.master.value} master"
            f"{kept} ({self.bytes_per_param:.2f} B/param)"
        )
