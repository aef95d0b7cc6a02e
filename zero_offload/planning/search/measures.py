"""What the planner may do about activations: checkpointing, the tiled loss, activation offload.

Each costs something, so the planner tries them from the cheapest (:func:`ladder`): nothing;
the tiled loss (the LM head's matrix multiply once more in backward, a few percent of a step);
checkpointing (the layers' forward once more: about a third more compute); both; both with the
checkpointed inputs offloaded to host memory (PCIe copies behind the compute, and host
memory). A measure the user fixed (``checkpointing=True``, ``tiled_loss=0``, ...) is kept in
every rung. :class:`MicroBatch` is what the planner sizes activations for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ...activations.config import DEFAULT_TILE_TOKENS, ActivationConfig
from ..estimate.activations import ActivationEstimate, DecoderShape, estimate_activations

__all__ = ["Measures", "MicroBatch", "ladder", "cheapest", "micro_batch_for", "explain"]


@dataclass(frozen=True)
class Measures:
    """One combination of the three. ``tile_tokens``: tokens per tile of the tiled loss (0:
    the plain loss)."""

    checkpointing: bool = False
    offload: bool = False
    tile_tokens: int = 0

    def kwargs(self) -> dict[str, Any]:
        """The ``initialize`` keywords (checkpointing is the model's own switch)."""
        out: dict[str, Any] = {}
        if self.offload:
            out["offload_activations"] = "checkpoints"
        if self.tile_tokens:
            out["tiled_loss"] = self.tile_tokens
        return out

    def describe(self) -> str:
        """'checkpointing, activation offload, the tiled loss (4096 tokens a tile)'."""
        parts = ["checkpointing" if self.checkpointing else "no checkpointing"]
        if self.offload:
            parts.append("activation offload")
        if self.tile_tokens:
            parts.append(f"the tiled loss ({self.tile_tokens} tokens a tile)")
        return ", ".join(parts)


def ladder(
    tokens: int,
    checkpointing: bool | None = None,
    offload: bool | None = None,
    tiled_loss: int | None = None,
) -> tuple[Measures, ...]:
    """The combinations to try, cheapest first; a measure given (not None) is fixed. The
    tiled loss only where a micro-batch has more tokens than a tile; offload only with
    checkpointing (it moves the checkpointed inputs)."""
    tiles = [0, DEFAULT_TILE_TOKENS] if tiled_loss is None else [tiled_loss]
    tiles = [t for t in tiles if t == 0 or t < tokens] or [0]
    ckpts = [False, True] if checkpointing is None else [checkpointing]
    offs = [False, True] if offload is None else [offload]
    out = []
    for off in offs:
        for ck in ckpts:
            for tile in tiles:
                if off and not ck:
                    continue
                out.append(Measures(ck, off, tile))
    if not out:
        raise ValueError("activation offload moves the checkpointed inputs: it needs checkpointing")
    # cost order: offload last, then checkpointing, then the tiled loss
    order = sorted(dict.fromkeys(out), key=lambda m: (m.offload, m.checkpointing, m.tile_tokens))
    return tuple(order)


def cheapest(
    rungs: tuple[Measures, ...], fits: Callable[[Measures], tuple[bool, int]]
) -> tuple[Measures, tuple[tuple[Measures, int], ...]]:
    """The first rung that ``fits`` (-> (fits, GPU bytes)) says fits, with the cheaper ones
    and their GPU bytes; the last rung when none does. The strongest rung with and without
    offload (the last of each) is tried first: if neither fits, no other does (offload
    trades GPU memory for host memory, so either may be the one that fits)."""
    strongest = {m.offload: m for m in rungs}.values()
    if not any(fits(m)[0] for m in strongest):
        return rungs[-1], ()
    cheaper: list[tuple[Measures, int]] = []
    for m in rungs:
        ok, gpu = fits(m)
        if ok:
            return m, tuple(cheaper)
        cheaper.append((m, gpu))
    raise AssertionError("a strongest rung fitted")  # pragma: no cover


def micro_batch_for(
    model: Any,
    micro_batch: tuple[int, int] | None,
    activation_bytes: int | None,
    dtype: torch.dtype | str,
    checkpointing: bool | None,
    offload: bool | None,
    tiled_loss: int | None,
) -> tuple["MicroBatch | None", tuple[Measures, ...]]:
    """What ``plan`` sizes activations for (None: ``activation_bytes`` as given), and the
    measures to try."""
    if micro_batch is None:
        if (checkpointing, offload, tiled_loss) != (None, None, None):
            raise ValueError(
                "checkpointing, offload_activations and tiled_loss size the activations of "
                "a micro-batch: give micro_batch=(sequences, tokens)"
            )
        return None, ()
    decoder = DecoderShape.of(model) if isinstance(model, nn.Module) else None
    if decoder is None:
        if activation_bytes is not None and (checkpointing, offload, tiled_loss) == (None,) * 3:
            return None, ()  # activations as given; the micro-batch counts a step's tokens
        raise ValueError(
            "the planner computes activations for Hugging Face Llama-kind models and the "
            "benchmark GPT, given as a model (the meta device is fine): for "
            f"{type(model).__name__} give activation_bytes as well (rehearse it to measure "
            "them); the micro-batch then only counts a step's tokens"
        )
    if activation_bytes is not None:
        raise ValueError("give activation_bytes or micro_batch, not both")
    if decoder.family == "gpt" and tiled_loss is None:
        tiled_loss = 0  # the benchmark GPT computes its own loss: nothing to tile it for it
    b, s = micro_batch
    micro = MicroBatch(decoder, b, s, dtype)
    return micro, ladder(micro.tokens, checkpointing, offload, tiled_loss)


def explain(
    measures: Measures | None,
    cheaper: tuple[tuple[Measures, int], ...],
    micro: "MicroBatch | None",
) -> str:
    """' Activations of 1 × 32768 tokens: checkpointing, ...; with checkpointing, the tiled
    loss the GPU would need 27.1 GB, which does not fit.'"""
    if measures is None or micro is None:
        return ""
    text = f" Activations of {micro.batch} × {micro.seq} tokens: {measures.describe()}"
    if cheaper:
        m, gpu = cheaper[-1]
        text += f"; with {m.describe()} the GPU would need {gpu / 1e9:.1f} GB, which does not fit"
    return text + "."


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch of ``batch`` sequences of ``seq`` tokens of a model of ``shape``."""

    shape: DecoderShape
    batch: int
    seq: int
    dtype: torch.dtype | str = torch.bfloat16
    base: ActivationConfig = ActivationConfig()  # offload's prefetch and the like

    def activations(self, measures: Measures) -> ActivationEstimate:
        cfg = ActivationConfig(
            mode="checkpoints" if measures.offload else "none",
            min_bytes=self.base.min_bytes,
            prefetch=self.base.prefetch,
            tiled_loss=measures.tile_tokens,
        )
        return estimate_activations(
            self.shape,
            batch=self.batch,
            seq=self.seq,
            dtype=self.dtype,
            checkpointing=measures.checkpointing,
            activations=cfg,
        )

    @property
    def tokens(self) -> int:
        return self.batch * self.seq
