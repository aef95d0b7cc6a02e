"""Adam(W) in float64 with a running bound on what float32 rounding can change.

Why: two correct float32 implementations of Adam differ by a few ulps that depend on the CPU
(vector width, FMA contraction, how sqrt and division are done), so comparing the kernel with
torch's float32 result under a fixed tolerance passes on one machine and fails on another.
Here both are compared with the exact math instead: ``torch.optim.Adam``/``AdamW`` run in
float64 on the same float32 inputs, and every float32 result must lie within a bound built by
first-order forward error analysis of torch's formula (unit roundoff ``U = 2**-24`` per
operation, each hyperparameter constant rounded once too), propagated step by step through
param, exp_avg and exp_avg_sq. The bound holds for any IEEE float32 implementation of the
formula on any CPU; it does not depend on which one is tested.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

U = 2.0**-24  # float32 unit roundoff (round to nearest)
TINY = 2.0**-126  # absolute slack for results in the subnormal range, where U does not hold
STATE_KEYS = ("exp_avg", "exp_avg_sq")


class Float32Bound:
    """A float64 reference trajectory and, per element, how far float32 may stray from it."""

    def __init__(
        self,
        p0: Tensor,
        *,
        adamw: bool,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        state: dict | None = None,
    ) -> None:
        self.param = p0.detach().double().clone().requires_grad_()
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        self.opt = cls(
            [self.param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )
        self.adamw = adamw
        if state is not None:  # start from a float32 state, taken as exact
            self.opt.state[self.param] = {
                "step": torch.tensor(float(state["step"]), dtype=torch.float64),
                **{k: state[k].detach().double().clone() for k in STATE_KEYS},
            }
        zero = torch.zeros_like(self.param, dtype=torch.float64)
        self.err = {"param": zero, "exp_avg": zero.clone(), "exp_avg_sq": zero.clone()}

    def state(self, key: str) -> Tensor:
        return self.param.detach() if key == "param" else self.opt.state[self.param][key]

    def step(self, grad: Tensor) -> None:
        """One step of the float64 optimizer with ``grad`` (a float32/bf16/fp16 tensor, taken
        as exact), and the bound grown by what float32 rounding of this step can add."""
        group = self.opt.param_groups[0]
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        st = self.opt.state[self.param]
        t = int(st["step"]) + 1 if st else 1
        p = self.param.detach().clone()
        g = grad.detach().double().reshape(p.shape)
        m = st["exp_avg"].clone() if st else torch.zeros_like(p)
        v = st["exp_avg_sq"].clone() if st else torch.zeros_like(p)
        ep, em, ev = self.err["param"], self.err["exp_avg"], self.err["exp_avg_sq"]

        if self.adamw:  # p *= 1 - lr*wd (constant rounded, product rounded)
            decay = 1 - lr * wd
            p1, ep1 = p * decay, ep * abs(decay) + 2 * U * (p * decay).abs()
            g1, eg = g, torch.zeros_like(p)
        else:  # g += wd * p
            p1, ep1 = p, ep
            g1 = g + wd * p
            eg = wd * ep + 3 * U * (g.abs() + wd * p.abs())
        # m = lerp(m, g, 1 - b1): a difference, a product or fma, weights rounded
        m1 = b1 * m + (1 - b1) * g1
        em1 = b1 * em + (1 - b1) * eg + 4 * U * (m.abs() + g1.abs())
        # v = b2*v + (1-b2)*g*g: every term is >= 0, so each rounding is relative to v
        v1 = b2 * v + (1 - b2) * g1 * g1
        ev1 = b2 * ev + (1 - b2) * (2 * g1.abs() * eg + eg * eg) + 8 * U * v1
        # d = sqrt(v) / sqrt(1 - b2^t) + eps
        bc1, bc2s = 1 - b1**t, math.sqrt(1 - b2**t)
        s = v1.sqrt()
        es = torch.minimum(ev1.sqrt(), ev1 / s.clamp_min(1e-300)) + 3 * U * s
        d = s / bc2s + eps
        ed = es / bc2s + 3 * U * s / bc2s + U * (d + eps)
        # p = p - (lr / bc1) * m / d
        a = lr / bc1
        upd = a * m1 / d
        eupd = (
            a * (em1 / d + m1.abs() * ed / (d * torch.maximum(d - ed, d / 2))) + 4 * U * upd.abs()
        )
        p2 = p1 - upd
        ep2 = ep1 + eupd + U * p2.abs()

        self.param.grad = g.clone()
        self.opt.step()
        # The bound models torch's formula: it must be the one torch just ran (on a sample,
        # which is enough to catch a different formula and keeps large runs cheap).
        pick = slice(None, None, max(1, p.numel() // 4096))
        for name, mine in (("param", p2), ("exp_avg", m1), ("exp_avg_sq", v1)):
            torch.testing.assert_close(
                self.state(name).flatten()[pick], mine.flatten()[pick], rtol=1e-9, atol=1e-15
            )
        self.err = {"param": ep2, "exp_avg": em1, "exp_avg_sq": ev1}

    def assert_within(self, who: str, param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
        """Every element of a float32 run lies within float32 rounding of the reference."""
        for name, got in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            ref, bound = self.state(name), self.err[name] + TINY
            diff = (got.detach().double().reshape(ref.shape) - ref).abs()
            bad = ~(diff <= bound)  # a NaN counts as outside
            if bad.any():
                i = int(bad.flatten().nonzero()[0])
                raise AssertionError(
                    f"{who}: {int(bad.sum())} of {bad.numel()} {name} elements are beyond "
                    f"float32 rounding of the float64 reference; first at {i}: "
                    f"got {got.flatten()[i].item()!r}, exact {ref.flatten()[i].item()!r}, "
                    f"|diff| {diff.flatten()[i].item():.3e} > bound {bound.flatten()[i].item():.3e}"
                )
