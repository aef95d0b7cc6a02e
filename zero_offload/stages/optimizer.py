"""This rank's slice of the fp32 master parameters, its AdamW state, and the update.

All units' shards sit end to end in one flat fp32 buffer (``master``), so the update is one call
over a long contiguous array — the shape a vectorized Adam wants — and a torch
``Optimizer`` over that single tensor gives users ``param_groups`` for lr schedulers. After
the update the new values go back to the compute-dtype parameters: into the rank's shard
(stage 3) or all-gathered into the full flat buffers (stages 0–2, persistent stage-3 units).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..comm import Comm
from ..config import ZeroConfig
from .loss_scale import LossScaler
from .units import FlatUnit

__all__ = ["ShardedOptimizer", "make_adamw"]


def make_adamw(params: list[torch.Tensor], cfg: ZeroConfig) -> torch.optim.Optimizer:
    """torch's AdamW, fused where the device supports it (same math, one pass over memory)."""
    o = cfg.optimizer
    kwargs = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):  # fused unsupported for this device/dtype
        return torch.optim.AdamW(params, **kwargs)


class ShardedOptimizer:
    def __init__(self, units: list[FlatUnit], cfg: ZeroConfig, comm: Comm,
                 grads: torch.Tensor) -> None:
        self.units = units
        self.cfg = cfg
        self.comm = comm
        self.stage = cfg.stage
        self.grads = grads
        total = sum(u.shard_numel for u in units)
        self.master = torch.empty(total, dtype=torch.float32, device=grads.device)
        for u in units:
            assert u.initial_master is not None
            self._slice(self.master, u).copy_(u.initial_master)
            u.initial_master = None
        self.master_param = nn.Parameter(self.master, requires_grad=False)
        self.optimizer = make_adamw([self.master_param], cfg)
        p = cfg.precision
        self.scaler = (LossScaler(p.initial_loss_scale, p.loss_scale_window, p.min_loss_scale)
                       if p.dtype == torch.float16 else None)
        self.last_grad_norm: float | None = None

    @staticmethod
    def _slice(flat: torch.Tensor, unit: FlatUnit) -> torch.Tensor:
        return flat[unit.shard_offset:unit.shard_offset + unit.shard_numel]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.grads.device)
        if self.stage > 0:
            self.comm.all_reduce(t, op="max")
        return bool(t.item())

    def _global_norm(self, grads32: torch.Tensor) -> float:
        sq = torch.linalg.vector_norm(grads32, dtype=torch.float32).pow(2).reshape(1)
        if self.stage > 0:  # stage 0: every rank holds the whole (already reduced) gradient
            self.comm.all_reduce(sq)
        return math.sqrt(float(sq.item()))

    def step(self) -> bool:
        """Unscale, check overflow, clip, update, write the params back. False: skipped."""
        grads32 = self.grads.float()
        if self.scaler is not None:
            grads32.mul_(1.0 / self.scaler.scale)
            overflow = self._any_rank(not bool(torch.isfinite(grads32).all()))
            self.scaler.update(overflow)
            if overflow:
                return False
        max_norm = self.cfg.optimizer.max_grad_norm
        if max_norm is not None:
            norm = self._global_norm(grads32)
            self.last_grad_norm = norm
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                grads32.mul_(coef)
        self.master_param.grad = grads32
        self.optimizer.step()
        self.master_param.grad = None
        self.write_back()
        return True

    def write_back(self) -> None:
        """Copy the updated master values into the compute-dtype parameters."""
        pending = []
        for u in self.units:
            src = self._slice(self.master, u)
            if u.sharded_params:
                u.param_shard.copy_(src)
            elif self.stage == 0:
                u.full.copy_(src)
            else:
                low = src.to(u.full.dtype)
                pending.append((self.comm.all_gather(u.full, low, async_op=True), low))
        for handle, _low in pending:
            handle.wait()

    def state_bytes(self) -> int:
        """Bytes of fp32 master + Adam moments held by this rank."""
        n = self.master.numel() * self.master.element_size()
        for state in self.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    n += state[key].numel() * state[key].element_size()
        return n
