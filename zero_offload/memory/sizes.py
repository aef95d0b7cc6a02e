"""Small sizing helpers of the memory model: dtype sizes, a pool's size under a budget (the
pool's own rule), the rough activation rule, and how parameter counts are written."""

from __future__ import annotations

import torch

from ..swap.buffers import pool_count, pool_footprint

__all__ = ["describe_params", "activation_memory", "dtype_bytes", "dtype_name", "pool_bytes"]


def describe_params(num_params: int, trainable_params: int, always: bool = False) -> str:
    """'13.00B params', or '13.00B params (50.0M trainable)' when not all train (or
    ``always``)."""
    text = f"{num_params / 1e9:.2f}B params"
    if always or trainable_params != num_params:
        count = (
            f"{trainable_params / 1e9:.2f}B"
            if trainable_params >= 1e9
            else f"{trainable_params / 1e6:.1f}M"
        )
        text += f" ({count} trainable)"
    return text


def activation_memory(
    *,
    seq: int,
    batch: int,
    width: int,
    layers: int,
    dtype: torch.dtype = torch.bfloat16,
    checkpointing: bool = True,
) -> int:
    """A rough per-GPU activation figure for a transformer: with activation checkpointing
    2 × seq × batch × width × layers elements (each block's input kept, plus as much again for
    the block being recomputed and the logits); without, 17 × that count (Korthikanti et al.,
    no attention-score term: SDPA/flash attention does not store it)."""
    per = 2 if checkpointing else 17
    return per * seq * batch * width * layers * dtype_bytes(dtype)


def dtype_bytes(dtype: torch.dtype | str) -> int:
    from ..config import compute_dtype

    return torch.empty(0, dtype=compute_dtype(dtype)).element_size()


def dtype_name(dtype: torch.dtype | str) -> str:
    from ..config import compute_dtype

    return str(compute_dtype(dtype)).removeprefix("torch.")


def pool_bytes(buffer_bytes: int, wanted: int, budget: int | None) -> int:
    """Host bytes of a swap pool: ``wanted`` buffers, fewer if the budget holds fewer (the
    pool's own rule), each rounded as the pool rounds it."""
    each = pool_footprint(buffer_bytes)
    count = wanted if budget is None else max(1, pool_count(each, wanted, budget))
    return count * each
