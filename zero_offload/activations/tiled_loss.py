"""The LM head and cross-entropy in tiles of the sequence: the full logits never exist.

A causal LM's loss materializes ``tokens × vocab`` logits, in the compute dtype and again in
fp32 for the cross-entropy, and as much again for their gradient: at 32k tokens and a 32k
vocabulary that is 4.2 GB for each fp32 copy, more than the rest of a checkpointed 13B
forward on one GPU. Here each tile of ``tile_tokens`` rows of the hidden states goes through
the head and the cross-entropy on its own, under a non-reentrant ``torch.utils.checkpoint``:
the forward keeps only each tile's loss, and the backward recomputes one tile's logits at a
time, takes their gradient and drops them. What it costs: the head's matrix multiply once
more (in backward). What it changes: the order of the sums (the tiles' losses, and the head's
weight gradient, which autograd adds up tile by tile); every row's logits and gradient are
computed as in the plain loss.

The arithmetic is Hugging Face's ``ForCausalLMLoss``: logits in the head's dtype, upcast to
fp32 from 16-bit types; labels shifted left by one with ``ignore_index`` padded in at the end (or
``shift_labels`` given as they are); the sum over non-ignored tokens divided by
``num_items_in_batch`` when given, else their mean.

Under stage 3 pass ``gather=engine.gathered`` (and call it through ``engine.run``, which is a
forward of the engine): the head's parameters are then gathered once for all tiles; the
backward's recomputation gathers them again as any recomputation does. A head that is not a
plain ``nn.Linear`` (an adapter, a quantized layer) is called as a module, tile by tile.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from .config import DEFAULT_TILE_TOKENS

__all__ = ["tiled_lm_loss", "tiled_causal_lm_loss", "check_tiled_model"]

Head = nn.Module | torch.Tensor
Gather = Callable[[nn.Module], ContextManager[Any]]

# config attributes of models whose logits are more than lm_head(hidden)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _project(head: Head) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(head, torch.Tensor):
        return lambda h: F.linear(h, head)
    if type(head) is nn.Linear:  # its parameters read at call time (stage 3 swaps them)
        return lambda h: F.linear(h, head.weight, head.bias)
    return head


def _tile_loss(
    project: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    logits = project(hidden)
    if logits.element_size() < 4:  # as Hugging Face upcasts; fp64 stays fp64
        logits = logits.float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def tiled_lm_loss(
    hidden: torch.Tensor,
    head: Head,
    labels: torch.Tensor,
    *,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift: bool = True,
    gather: Gather | None = None,
) -> torch.Tensor:
    """The cross-entropy of ``head(hidden)`` against ``labels``, ``tile_tokens`` rows at a time.

    ``hidden``: (..., tokens, width), the model's last hidden states; ``head``: the output
    projection (an ``nn.Linear``, any module, or a weight tensor); ``labels``: (..., tokens),
    shifted left by one first when ``shift`` (as Hugging Face does with ``labels``; pass
    ``shift=False`` for labels already aligned, its ``shift_labels``). ``gather``: a context
    that holds the head's parameters gathered (``engine.gathered`` under stage 3)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    width = hidden.shape[-1]
    rows = hidden.reshape(-1, width)
    targets = labels.reshape(-1).to(rows.device)
    if targets.numel() != rows.shape[0]:
        raise ValueError(
            f"labels have {targets.numel()} tokens, the hidden states {rows.shape[0]}: "
            "give labels of the input's shape"
        )
    project = _project(head)
    hold = (
        gather(head)
        if gather is not None and isinstance(head, nn.Module)
        else contextlib.nullcontext()
    )
    total: torch.Tensor | None = None
    with hold:
        for start in range(0, rows.shape[0], tile_tokens):
            h, y = rows[start : start + tile_tokens], targets[start : start + tile_tokens]
            if torch.is_grad_enabled():
                part = checkpoint(
                    _tile_loss,
                    project,
                    h,
                    y,
                    ignore_index,
                    use_reentrant=False,
                    preserve_rng_state=False,
                )
            else:
                part = _tile_loss(project, h, y, ignore_index)
            total = part if total is None else total + part
    if total is None:  # no tokens: the plain loss's nan
        total = rows.sum() * float("nan")
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def check_tiled_model(model: nn.Module) -> nn.Module:
    """``model``'s output projection, where the tiled loss computes what its forward would:
    a causal LM whose logits are ``lm_head(last hidden state)``; else a :class:`ConfigError`."""
    config = getattr(model, "config", None)
    find = getattr(model, "get_output_embeddings", None)
    head = find() if callable(find) else None
    if head is None or config is None or not hasattr(model, "get_decoder"):
        raise ConfigError(
            f"tiled_loss: {type(model).__name__} is not a Hugging Face causal LM with an "
            "output embedding (get_output_embeddings) and a decoder (get_decoder); set "
            "tiled_loss=0 or compute the loss with zero_offload.activations.tiled_lm_loss"
        )
    for name in _LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ConfigError(
                f"tiled_loss: {type(model).__name__} transforms its logits ({name}="
                f"{getattr(config, name)!r}), which the tiled loss does not; set tiled_loss=0"
            )
    return head


def tiled_causal_lm_loss(
    model: nn.Module,
    *,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    gather: Gather | None = None,
    **inputs: Any,
) -> torch.Tensor:
    """A Hugging Face causal LM's training loss (what ``model(**inputs, labels=labels).loss``
    is), through the tiled loss: the decoder runs, then :func:`tiled_lm_loss` on its last
    hidden states. Under an engine: ``engine.run(tiled_causal_lm_loss, engine.module,
    input_ids=..., labels=..., gather=engine.gathered)``."""
    head = check_tiled_model(model)
    targets = shift_labels if shift_labels is not None else labels
    if targets is None:
        raise ValueError("tiled_causal_lm_loss needs labels (or shift_labels)")
    inputs.pop("logits_to_keep", None)
    inputs.pop("return_dict", None)
    decoder: Any = model.get_decoder()  # type: ignore[operator]
    out = decoder(**inputs, return_dict=True)
    return tiled_lm_loss(
        out.last_hidden_state,
        head,
        targets,
        tile_tokens=tile_tokens,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        shift=shift_labels is None,
        gather=gather,
    )
