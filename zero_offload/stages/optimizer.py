"""This rank's slice of the fp32 master parameters, its AdamW state, and the update.

All units' shards sit end to end in one rank-flat buffer, so the update is one call over a long
contiguous array — the shape a vectorized Adam wants — and a torch ``Optimizer`` over it gives
users ``param_groups`` for lr schedulers. Where that state lives (device, host, NVMe) is the
updater's business (``stages.updaters``); this class prepares the gradients (unscale, overflow
check, global-norm clipping) and writes the new values back to the compute-dtype parameters:
into the rank's shard (stage 3) or all-gathered into the full flat buffers (stages 0–2 and
persistent stage-3 units).
"""
from __future__ import annotations

import math

import torch

from ..comm import Comm
from ..config import ZeroConfig
from ..ledger import MemoryReport
from .loss_scale import LossScaler
from .units import FlatUnit
from .updaters import make_updater

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer:
    def __init__(self, units: list[FlatUnit], cfg: ZeroConfig, comm: Comm,
                 grads: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 param_shards: torch.Tensor | None = None) -> None:
        self.units = units
        self.cfg = cfg
        self.comm = comm
        self.stage = cfg.stage
        self.grads = grads
        self.device = device  # scalars for collectives live here (NCCL needs device tensors)
        initial = []
        for u in units:
            assert u.initial_master is not None
            initial.append((u.shard_offset, u.initial_master.cpu() if
                            cfg.offload.optimizer != "none" else u.initial_master))
            u.initial_master = None
        self.updater = make_updater(initial, grads.numel(), cfg, device, dtype, comm.rank,
                                    param_shards)
        self.optimizer = self.updater.optimizer
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
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        if self.stage > 0:
            self.comm.all_reduce(t, op="max")
        return bool(t.item())

    def _global_norm(self, grads32: torch.Tensor) -> float:
        sq = torch.linalg.vector_norm(grads32, dtype=torch.float32).pow(2).reshape(1)
        sq = sq.to(self.device)
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
        self.write_back(self.updater.update(grads32))
        return True

    def write_back(self, new: torch.Tensor) -> None:
        """Copy the updated values (rank-flat, fp32 or compute dtype, any device) into the
        compute-dtype parameters."""
        pending = []
        for u in self.units:
            src = self._slice(new, u).to(u.full.device, non_blocking=True)
            if u.sharded_params:
                if src.data_ptr() != u.param_shard.data_ptr():  # not updated in place
                    u.param_shard.copy_(src)
            elif self.stage == 0:
                u.full.copy_(src)
            else:
                low = src.to(u.full.dtype)
                pending.append((self.comm.all_gather(u.full, low, async_op=True), low))
        for handle, _low in pending:
            handle.wait()

    def add_to(self, report: MemoryReport) -> None:
        self.updater.add_to(report)

    def close(self) -> None:
        self.updater.close()
