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

import bisect
import math

import torch

from ..comm import Comm
from ..config import ZeroConfig
from ..ledger import MemoryReport
from ..swap.pinned import host_empty, pinned_nbytes, unpin
from .loss_scale import LossScaler
from .param_store import ParamStore
from .streams import Streams
from .units import FlatUnit
from .updaters import Updater

__all__ = ["ShardStepper"]


class ShardStepper:
    def __init__(self, units: list[FlatUnit], cfg: ZeroConfig, comm: Comm,
                 grads: torch.Tensor | None,
                 device: torch.device, dtype: torch.dtype, updater: Updater,
                 params: ParamStore | None, streams: Streams) -> None:
        self.units = units
        self.cfg = cfg
        self.comm = comm
        self.stage = cfg.stage
        self.grads = grads  # None: the gradients are in files (NVMe optimizer, small budget)
        self.device = device  # scalars for collectives live here (NCCL needs device tensors)
        self.dtype = dtype
        self.updater = updater
        self.optimizer = updater.optimizer
        self.params = params
        self.streams = streams
        # the units the updater steps, in rank-flat order (frozen ones come after them)
        self._stepped = sorted((u for u in units if not u.frozen), key=lambda u: u.shard_offset)
        self._starts = [u.shard_offset for u in self._stepped]
        largest = max((u.shard_numel for u in units), default=0)
        # A unit split across NVMe sub-groups is assembled here before it is stored.
        self._staging = host_empty(largest, dtype, crosses_pcie=True) \
            if cfg.offload.optimizer == "nvme" else None
        p = cfg.precision
        self.scaler = (LossScaler(p.initial_loss_scale, p.loss_scale_window, p.min_loss_scale)
                       if p.dtype == torch.float16 else None)
        self._grad_norm: float | torch.Tensor | None = None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        if self.stage > 0:
            self.comm.all_reduce(t, op="max")
        return bool(t.item())

    def _grad_stats(self) -> tuple[float, bool]:
        """This rank's (sum of squares, all finite) of its reduced gradient shard, summed in
        fp64 — so that the per-sub-group sums of gradients in files agree to the last bit of
        the fp32 clip factor — without a copy of the shard."""
        if self.grads is None:
            return self.updater.grad_stats()  # type: ignore[attr-defined]
        sumsq = 0.0
        if self.cfg.optimizer.max_grad_norm is not None:
            sumsq = float(torch.linalg.vector_norm(self.grads, dtype=torch.float64).item()) ** 2
        finite = self.scaler is None or bool(torch.isfinite(self.grads).all())
        return sumsq, finite

    def step(self) -> bool:
        """Check overflow, clip, update, write the params back. False: skipped (overflow).

        Unscaling and clipping fold into one factor that the updater applies as it reads the
        gradients: no pass over them here, and no fp32 copy of a low-precision shard."""
        self.streams.sync_h2d()  # host shards some copy still reads may be overwritten now
        if self.scaler is None and self.grads is not None and self.grads.device.type != "cpu":
            self.updater.update(self.grads, self._device_factor(), self._sink)
            return True
        sumsq, finite = self._grad_stats()
        scale = self.loss_scale
        if self.scaler is not None:
            overflow = self._any_rank(not finite)
            self.scaler.update(overflow)
            if overflow:
                return False
        factor = 1.0 / scale
        max_norm = self.cfg.optimizer.max_grad_norm
        if max_norm is not None:
            sq = torch.tensor([sumsq], dtype=torch.float64 if self.device.type == "cpu"
                              else torch.float32, device=self.device)
            if self.stage > 0:  # stage 0: every rank holds the whole (reduced) gradient
                self.comm.all_reduce(sq)
            norm = math.sqrt(float(sq.item())) / scale
            self._grad_norm = norm
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                factor *= coef
        self.updater.update(self.grads, factor, self._sink)
        return True

    def _device_factor(self) -> float | torch.Tensor:
        """The clip factor of gradients on an accelerator, as a device tensor: the norm is
        never brought to the host, so the step queues its kernels without waiting for the
        backward's. (float16 needs the overflow flag on the host and takes the other path.)"""
        max_norm = self.cfg.optimizer.max_grad_norm
        if max_norm is None:
            return 1.0
        assert self.grads is not None
        sq = torch.linalg.vector_norm(self.grads, dtype=torch.float32).square().reshape(1)
        if self.stage > 0:
            self.comm.all_reduce(sq)
        norm = sq.sqrt()
        self._grad_norm = norm
        return (max_norm / (norm + 1e-6)).clamp(max=1.0)

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (with clipping on). Reading it after a
        step on an accelerator waits for that step's norm."""
        norm = self._grad_norm
        return float(norm.item()) if isinstance(norm, torch.Tensor) else norm

    def _sink(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """New values for rank-flat [lo, hi): hand every unit completed by them to
        :meth:`write_params` (a unit cut by a sub-group boundary waits in the staging buffer)."""
        first = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        for u in self._stepped[first:]:
            start, end = u.shard_offset, u.shard_offset + u.shard_numel
            if start >= hi:
                break
            if start >= lo and end <= hi:
                self.write_params(u, values[start - lo:end - lo])
                continue
            assert self._staging is not None, "only NVMe sub-groups cut units"
            a, b = max(lo, start), min(hi, end)
            if a == start:  # a copy issued above may still read the staging buffer
                self.streams.sync_h2d()
            self._staging[a - start:b - start].copy_(values[a - lo:b - lo])
            if b == end:
                self.write_params(u, self._staging[:u.shard_numel])
        self.streams.sync_h2d()  # copies issued above read ``values`` (and the staging)

    def write_params(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        """Write a unit's updated shard into its compute-dtype parameters. A host shard goes
        to an accelerator on the host-to-device stream; the all-gather waits for it on the
        device, and the next unit's copy runs while this unit's all-gather does."""
        if unit.sharded_params:
            assert self.params is not None
            self.params.put(unit, shard.to(self.dtype))
        elif self.stage == 0:
            unit.full.copy_(shard)
        elif shard.device.type == "cpu" and self.streams.cuda:
            values, copied = self.streams.to_device(shard, self.dtype)
            self.streams.wait(copied)
            self.streams.handed_over(values)
            self.comm.all_gather(unit.full, values)
            if copied is not None:  # the caller reuses ``shard`` when this returns
                copied.synchronize()
        else:
            self.comm.all_gather(unit.full, shard.to(device=unit.full.device, dtype=self.dtype))

    def add_to(self, report: MemoryReport) -> None:
        if self._staging is not None:  # small, outside host_memory_limit: only its lock counts
            report.pinned_bytes += pinned_nbytes(self._staging)
        self.updater.add_to(report)
        if self.params is not None:
            self.params.add_to(report)

    def release_staging(self) -> None:
        """Unpin the buffer that assembles cut units (the updater and the parameter store
        are closed by their owner, the engine)."""
        unpin(self._staging)
