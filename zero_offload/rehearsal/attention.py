"""Attention as a GPU runs it, on the simulated device.

``F.scaled_dot_product_attention`` picks its kernel by the tensors' device: on CUDA a fused
flash or memory-efficient kernel (outputs and a log-sum-exp row kept for backward, memory
linear in the sequence), anywhere else — the meta device included — the math path, which
materialises ``heads × s²`` scores and keeps them for backward. A rehearsal that let the
meta device decide would count, at 8k tokens, several GB a layer that no GPU allocates.

:class:`GpuAttention` (a ``TorchFunctionMode``, torch's extension point for seeing each torch
call) makes the choice a GPU would make for those dtypes and shapes (:func:`choose_kernel`:
the rules of torch's ``select_sdp_backend`` on an sm86/sm89 GPU, the 24 GB class), and runs
that kernel's own aten operator, whose meta kernel allocates what the CUDA kernel returns
and whose autograd node saves what it saves. What the CUDA kernels allocate and free inside
themselves (the fp32 dQ accumulator of their backward) is :func:`kernel_scratch`, counted by
the tracker while the operator runs. ``kernel="math"`` counts the math path instead (what
torch falls back to, and about what a model's eager attention keeps).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["KERNELS", "GpuAttention", "choose_kernel", "kernel_scratch", "describe_kernels"]

# "auto": what a GPU picks; the others force one (a forced fused kernel still needs inputs
# it can take: flash has no mask). "eager": the model's own eager attention (HF models
# built by name), which calls no SDPA at all.
KERNELS = ("auto", "flash", "efficient", "math", "eager")
_HALF = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten
_FLASH_BACKWARD = _aten._scaled_dot_product_flash_attention_backward.default
_EFFICIENT_FORWARD = _aten._scaled_dot_product_efficient_attention.default
_EFFICIENT_BACKWARD = _aten._scaled_dot_product_efficient_attention_backward.default
# calls that run autograd's engine: the mode must stay on while they run, for the forward a
# checkpoint recomputes in backward
_RUN_BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def choose_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the kernel torch's SDPA runs for these
    inputs on an sm86/sm89 GPU (flash first, then memory-efficient, then math; cuDNN is
    preferred only on sm90/sm100)."""
    dense = query.dim() == key.dim() == value.dim() == 4
    if not dense or 0 in (query.shape[-2], key.shape[-2]):
        return "math"
    hq, hk = query.shape[-3], key.shape[-3]
    heads_ok = hq == hk or (enable_gqa and hk == value.shape[-3] and hq % hk == 0)
    d, dk, dv = query.shape[-1], key.shape[-1], value.shape[-1]
    strides_ok = all(t.stride(-1) == 1 for t in (query, key, value))
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if (
        attn_mask is None
        and query.dtype in _HALF
        and d == dk == dv <= 256
        and (not training or d <= 192 or (d > 224 and dropout_p == 0))
        and (not is_causal or query.shape[-2] == key.shape[-2])
        and heads_ok
        and strides_ok
    ):
        return "flash"
    align = 8 if query.dtype in _HALF else 4  # the GEMMs' minimum alignment, in elements
    offsets_ok = all(
        (t.storage_offset() * t.element_size()) % (align * t.element_size()) == 0
        for t in (query, key, value)
    )
    if (
        query.dtype in (*_HALF, torch.float32)
        and d == dk
        and d % align == 0
        and dv % align == 0
        and heads_ok
        and strides_ok
        and offsets_ok
    ):
        return "efficient"
    return "math"


def kernel_scratch(func: Any, args: tuple) -> int:
    """Device bytes a fused attention kernel allocates and frees inside itself (beyond what
    its operator returns), for the tracker to count while ``func`` runs; 0 for any other
    operation. Flash backward: the fp32 dQ accumulator (sequence rounded to 128, head dim to
    32) and the softmax row sums, plus dK/dV per query head under GQA; memory-efficient
    backward: its fp32 dQ accumulator and row sums; its forward with a head dim over 128: an
    fp32 output accumulator."""
    if func is _FLASH_BACKWARD:
        q, k = args[1], args[2]
        b, h, s, d = q.shape
        d_rounded = _round(d, 32) if d <= 192 else 256
        total = 4 * b * h * _round(s, 128) * (1 + d_rounded)
        if k.shape[1] != h:  # GQA: dK and dV per query head, summed over the group after
            total += 2 * b * h * k.shape[2] * d * q.element_size()
        return total
    if func is _EFFICIENT_BACKWARD:
        q = args[1]
        b, h, s, d = q.shape
        return 4 * b * h * s * (1 + d)
    if func is _EFFICIENT_FORWARD and args[2].shape[-1] > 128:
        q, v = args[0], args[2]
        b, h, s, _ = q.shape
        return 4 * b * h * s * v.shape[-1]
    return 0


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, causal: bool, scale: Any):
    d = q.shape[-1]
    if d % 8:  # the kernel takes head dims in multiples of 8: torch pads, then slices
        pad = 8 - d % 8
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        if scale is None:
            scale = d**-0.5
    out = _aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
    return out[..., :d] if out.shape[-1] != d else out


def _efficient(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    causal: bool,
    scale: Any,
    gqa: bool,
):
    if gqa and k.shape[-3] != q.shape[-3]:  # the kernel wants a key/value head per query head
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    if mask is not None:
        if mask.dtype == torch.bool:  # an additive bias, as torch converts it
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if mask.shape[-1] % 16:  # the kernel reads the bias in rows of 16
            last = mask.shape[-1]
            mask = F.pad(mask, (0, 16 - last % 16))[..., :last]
        elif any(s % 16 for s in mask.stride()[:3]):
            mask = mask.contiguous()
    lse = any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled()
    return _aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, lse, p, causal, scale=scale
    )[0]


class GpuAttention(TorchFunctionMode):
    """Runs each ``F.scaled_dot_product_attention`` call with the kernel a GPU would use
    (``kernel="auto"``) or the one named (``"flash"``, ``"efficient"``, ``"math"``), and
    counts the calls per kernel in ``calls``."""

    def __init__(self, kernel: str = "auto") -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"attention kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
        self.kernel = kernel
        self.calls: Counter[str] = Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func in _RUN_BACKWARD:  # torch took the mode off for this call: put it back
            with self:
                return torch.overrides.redispatch_function(func, types, args, kwargs)
        return func(*args, **kwargs)

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        gpu = choose_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        kernel = gpu if self.kernel in ("auto", "eager") else self.kernel
        if kernel == "flash" and gpu != "flash":
            raise ValueError(
                "attention kernel 'flash' forced, but a GPU cannot run flash attention on "
                f"these inputs (it would use {gpu}): flash takes no attn_mask, fp16/bf16 "
                "only, head dims <= 256"
            )
        self.calls[kernel] += 1
        if kernel == "flash":
            return _flash(query, key, value, dropout_p, is_causal, scale)
        if kernel == "efficient":
            return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )


def describe_kernels(kernel: str, calls: dict[str, int]) -> str:
    """'flash (as a GPU picks it: 160 calls)', for the report."""
    how = {
        "auto": "as an sm86/sm89 GPU picks it",
        "eager": "the model's eager attention",
        "math": "forced: the math path, s² scores kept",
    }.get(kernel, "forced")
    if kernel == "eager" and not calls:
        return "eager (the model's own attention code: s² scores kept)"
    used = ", ".join(f"{k} × {n}" for k, n in sorted(calls.items())) or "no SDPA call"
    names = "/".join(sorted(calls)) or kernel
    return f"{names} ({how}; calls: {used})"
