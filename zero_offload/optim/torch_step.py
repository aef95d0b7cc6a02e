"""The optimizer step over a span in plain torch: the fallback where the C kernel is not
built, and a readable statement of what the kernel computes (same rules: blockwise
quantization by :mod:`.quant`, stochastic rounding by :mod:`.rounding`; the update math
agrees within fp32 rounding, the kernel using explicit FMAs where torch's optimizers do).

Works segment by segment (see :mod:`.layout`): a quantized piece is dequantized, updated and
requantized as a whole, which allocates fp32 temporaries of the piece; the kernel does it a
block at a time in registers and L1."""

from __future__ import annotations

import torch

from .hyper import StepHyper
from .policy import MasterPrecision, MomentPrecision, OptimizerKind
from .quant import dequantize_blocks, quantize_blocks
from .rounding import STREAMS, round_bf16_stochastic, sr_bits, stream_seed
from .state import ShardState

__all__ = ["torch_step"]


def torch_step(
    state: ShardState,
    grad: torch.Tensor,
    hyper: StepHyper,
    out: torch.Tensor | None,
    index_base: int,
) -> None:
    """Step every element of ``state.span`` in place (see :func:`~.step.step`)."""
    pol = state.policy
    signed = dict(zip(pol.moment_names, pol.kind.signed_moments))
    for seg in state.span.segments():
        e = slice(seg.start, seg.end)
        g = grad[e].float() * hyper.grad_scale
        if state.compensation is not None:
            p = state.master[e].float() + state.compensation[e].float()
        else:
            p = state.master[e].float()
        moments = {}
        for name, m in state.moments.items():
            if not pol.quantized:
                moments[name] = m.values[e].float()
            elif seg.quantized:
                assert m.absmax is not None
                absmax = m.absmax[seg.block : seg.block + seg.blocks]
                moments[name] = dequantize_blocks(m.values[e], absmax, seg.phase, signed[name])
            else:
                assert m.side is not None
                moments[name] = m.side[seg.side : seg.side + seg.numel].clone()
        p = _update(pol.kind, p, g, moments, hyper)
        base = index_base + seg.start
        key = stream_seed(hyper.seed, hyper.step, STREAMS["moments"])
        for which, (name, m) in enumerate(state.moments.items()):
            value = moments[name]
            if pol.moments is MomentPrecision.BF16:
                bits = sr_bits(base, seg.numel, key, high=which == 1)
                m.values[e].copy_(round_bf16_stochastic(value, bits))
            elif not pol.quantized:
                m.values[e].copy_(value)
            elif seg.quantized:
                assert m.absmax is not None
                codes, absmax = quantize_blocks(value, seg.phase, signed[name])
                m.values[e].copy_(codes)
                m.absmax[seg.block : seg.block + seg.blocks].copy_(absmax)
            else:
                assert m.side is not None
                m.side[seg.side : seg.side + seg.numel].copy_(value)
        if pol.master is MasterPrecision.FP32:
            state.master[e].copy_(p)
        elif pol.master is MasterPrecision.BF16_KAHAN:
            assert state.compensation is not None
            hi = p.to(torch.bfloat16)
            state.master[e].copy_(hi)
            state.compensation[e].copy_((p - hi.float()).to(torch.bfloat16))
        else:
            key = stream_seed(hyper.seed, hyper.step, STREAMS["master"])
            state.master[e].copy_(round_bf16_stochastic(p, sr_bits(base, seg.numel, key)))
        if out is not None:
            if out.dtype == state.master.dtype:  # a bf16 master's own bits
                out[e].copy_(state.master[e])
            else:  # the value the master stands for, rounded to the out dtype
                value = p if pol.master is MasterPrecision.FP32 else state.master[e].float()
                if state.compensation is not None:
                    value = value + state.compensation[e].float()
                out[e].copy_(value)


def _update(
    kind: OptimizerKind,
    p: torch.Tensor,
    g: torch.Tensor,
    moments: dict[str, torch.Tensor],
    h: StepHyper,
) -> torch.Tensor:
    """One step of ``kind`` on fp32 values, written as torch's own optimizers write it (the
    kernel fuses exactly where these ops do); moments in place, the new p returned."""
    if kind is OptimizerKind.LION:  # Chen et al. 2023, Algorithm 2
        m = moments["exp_avg"]
        direction = m.mul(h.beta1).add_(g, alpha=1 - h.beta1).sign_()
        p = p.mul(1 - h.lr * h.weight_decay).add_(direction, alpha=-h.lr)
        m.mul_(h.beta2).add_(g, alpha=1 - h.beta2)
        return p
    if kind is OptimizerKind.ADAGRAD:  # torch.optim.Adagrad, single-tensor
        s = moments["sum"]
        g = g.add(p, alpha=h.weight_decay)
        s.addcmul_(g, g, value=1)
        clr = h.lr / (1 + (h.step - 1) * h.lr_decay)
        return p.addcdiv(g, s.sqrt().add_(h.eps), value=-clr)
    m, v = moments["exp_avg"], moments["exp_avg_sq"]  # torch.optim.Adam(W), single-tensor
    if kind is OptimizerKind.ADAMW:
        p = p.mul(1 - h.lr * h.weight_decay)
    else:
        g = g.add(p, alpha=h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    bc1 = 1 - h.beta1**h.step
    bc2_sqrt = (1 - h.beta2**h.step) ** 0.5
    denom = (v.sqrt() / bc2_sqrt).add_(h.eps)
    return p.addcdiv(m, denom, value=-(h.lr / bc1))
