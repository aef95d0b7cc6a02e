"""Where the optimizer state lives and how the AdamW update runs on it.

Three updaters share one face — ``update(grads32) -> new params (rank-flat)`` plus a torch
``optimizer`` whose ``param_groups`` carry the hyperparameters (lr schedulers drive it):

- :class:`DeviceAdam`: fp32 master, m, v on an accelerator; torch's fused AdamW.
- :class:`HostAdam` (``offload_optimizer="cpu"``, and the no-offload case when the compute
  device is the CPU): the state in host memory, updated by the vectorized CPU Adam, which also
  writes the compute-dtype params in the same pass, so only 2 bytes per parameter travel back
  to the device. Every CPU tier runs this same kernel, so offloading changes no bit.
- :class:`NvmeAdam` (``offload_optimizer="nvme"``): master, m and v of each sub-group sit in one
  file; the step is a pipeline over sub-groups — group i+1 is read while group i computes and
  group i−1 is written — through a pool of three host buffers sized within
  ``host_memory_limit``.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
import torch.nn as nn

from ..config import ZeroConfig
from ..ledger import MemoryReport
from ..optim import CPUAdam, adam_update
from ..swap.buffers import HostBuffer
from ..swap.swapper import Swapper

__all__ = ["Updater", "StepTimings", "DeviceAdam", "HostAdam", "NvmeAdam", "make_updater"]

log = logging.getLogger(__name__)

_PAGE_ELEMS = 1024  # fp32 elements per 4 KiB: sub-groups start page-aligned in their files


Sink = Callable[[int, int, torch.Tensor], None]
"""Receives the new parameter values of rank-flat elements [lo, hi) (fp32 or compute dtype),
in increasing order; it must be done with the tensor when it returns."""


@dataclass
class StepTimings:
    """Seconds of the last update: I/O time summed over requests (submit to completion),
    Adam compute, and wall time. ``overlap`` = max(read + write, compute) / wall: 1.0 when
    the slower of I/O and compute hides the other completely."""

    read_s: float = 0.0
    write_s: float = 0.0
    compute_s: float = 0.0
    wall_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0

    @property
    def overlap(self) -> float:
        busy = max(self.read_s + self.write_s, self.compute_s)
        return busy / self.wall_s if self.wall_s > 0 else 1.0


StateChunk = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]
"""(lo, hi, master, exp_avg, exp_avg_sq) for rank-flat elements [lo, hi), fp32 on the CPU."""


class Updater(Protocol):
    optimizer: torch.optim.Optimizer
    steps: int
    last_timings: StepTimings

    def load_state(self, offset: int, master: torch.Tensor, exp_avg: torch.Tensor | None = None,
                   exp_avg_sq: torch.Tensor | None = None) -> None: ...
    def iter_state(self) -> Iterator[StateChunk]: ...
    def update(self, grads32: torch.Tensor, sink: Sink) -> None: ...
    def master_values(self) -> torch.Tensor: ...
    def add_to(self, report: MemoryReport) -> None: ...
    def close(self) -> None: ...


def _adam_kwargs(cfg: ZeroConfig) -> dict:
    o = cfg.optimizer
    return dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


_CHUNK = 1 << 24  # elements per piece when state is streamed off an accelerator


class _ResidentAdam:
    """Master and moments as whole tensors in memory (device or host), with torch's
    optimizer-state layout: ``optimizer.state[param]`` holds step, exp_avg, exp_avg_sq."""

    tier = "device"

    def __init__(self, master: torch.Tensor, optimizer: torch.optim.Optimizer,
                 param: nn.Parameter) -> None:
        self.master, self.optimizer, self.param = master, optimizer, param
        self.last_timings = StepTimings()

    @property
    def steps(self) -> int:
        step = self.optimizer.state.get(self.param, {}).get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    @steps.setter
    def steps(self, value: int) -> None:
        self._moments()["step"].fill_(float(value))

    def _moments(self) -> dict:
        """The optimizer's state for the master, created (zeros) if no step ran yet."""
        state = self.optimizer.state[self.param]
        if "exp_avg" not in state:
            fused = getattr(self.optimizer, "defaults", {}).get("fused")
            state["step"] = torch.zeros((), dtype=torch.float32,
                                        device=self.master.device if fused else "cpu")
            state["exp_avg"] = torch.zeros_like(self.master)
            state["exp_avg_sq"] = torch.zeros_like(self.master)
        return state

    def load_state(self, offset: int, master: torch.Tensor, exp_avg: torch.Tensor | None = None,
                   exp_avg_sq: torch.Tensor | None = None) -> None:
        end = offset + master.numel()
        self.master[offset:end].copy_(master)
        if exp_avg is not None or exp_avg_sq is not None:
            state = self._moments()
            for key, values in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                if values is not None:
                    state[key][offset:end].copy_(values)

    def iter_state(self) -> Iterator[StateChunk]:
        state = self._moments()
        n = self.master.numel()
        step = max(n, 1) if self.master.device.type == "cpu" else _CHUNK  # CPU: no copies
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            yield (lo, hi, *(t[lo:hi].cpu() for t in
                             (self.master, state["exp_avg"], state["exp_avg_sq"])))

    def master_values(self) -> torch.Tensor:
        return self.master

    def add_to(self, report: MemoryReport) -> None:
        state = self.optimizer.state.get(self.param, {})
        report.add(self.tier, "optimizer", _nbytes(self.master) + _nbytes(state.get("exp_avg"))
                   + _nbytes(state.get("exp_avg_sq")))

    def close(self) -> None:
        pass


class DeviceAdam(_ResidentAdam):
    """fp32 master + AdamW state on an accelerator: torch's fused AdamW."""

    def __init__(self, master: torch.Tensor, cfg: ZeroConfig) -> None:
        param = nn.Parameter(master, requires_grad=False)
        try:
            optimizer = torch.optim.AdamW([param], fused=True, **_adam_kwargs(cfg))
        except (RuntimeError, TypeError, ValueError):  # fused not supported on this device
            optimizer = torch.optim.AdamW([param], **_adam_kwargs(cfg))
        super().__init__(master, optimizer, param)

    def update(self, grads32: torch.Tensor, sink: Sink) -> None:
        start = time.perf_counter()
        self.param.grad = grads32
        self.optimizer.step()
        self.param.grad = None
        elapsed = time.perf_counter() - start
        self.last_timings = StepTimings(compute_s=elapsed, wall_s=elapsed)
        sink(0, self.master.numel(), self.master)


class HostAdam(_ResidentAdam):
    """fp32 master + AdamW state in host memory, stepped by the CPU Adam kernel. ``tier``
    names it in the ledger: "host" when offloaded, "device" when the CPU is the device."""

    def __init__(self, master: torch.Tensor, cfg: ZeroConfig, dtype: torch.dtype,
                 tier: str = "host", out: torch.Tensor | None = None) -> None:
        param = nn.Parameter(master, requires_grad=False)
        super().__init__(master, CPUAdam([param], adamw=True, **_adam_kwargs(cfg)), param)
        self.tier = tier
        # The kernel writes the compute-dtype params into ``out`` in the same pass: the
        # caller's buffer when it lives in host memory (stage 3's param shards), else ours.
        self.owns_out = out is None and dtype != torch.float32
        self.out = torch.empty(master.numel(), dtype=dtype) if self.owns_out else out
        if dtype == torch.float32:
            self.out = None

    def update(self, grads32: torch.Tensor, sink: Sink) -> None:
        start = time.perf_counter()
        self.optimizer.step_param(self.param, grads32, out=self.out)
        elapsed = time.perf_counter() - start
        self.last_timings = StepTimings(compute_s=elapsed, wall_s=elapsed)
        sink(0, self.master.numel(), self.master if self.out is None else self.out)

    def add_to(self, report: MemoryReport) -> None:
        super().add_to(report)
        if self.owns_out:
            report.add(self.tier, "params", _nbytes(self.out))


class NvmeAdam:
    """Master, m and v in files, one per sub-group, stepped as a read/compute/write pipeline."""

    BUFFERS = 3  # one being read ahead, one computing, one being written back

    def __init__(self, numel: int, cfg: ZeroConfig, dtype: torch.dtype, rank: int,
                 host_memory_limit: int | None) -> None:
        off = cfg.offload
        self.numel = numel
        self.group = self._group_size(off.sub_group_size, host_memory_limit, numel)
        self.bounds = [(lo, min(lo + self.group, numel)) for lo in range(0, numel, self.group)]
        self.swapper = Swapper(off.nvme_path, buffer_bytes=12 * self.group,
                               buffer_count=self.BUFFERS, min_buffers=2,
                               host_memory_limit=host_memory_limit,
                               expected_bytes=12 * numel, rank=rank)
        # The optimizer holds no tensors of its own: its param_groups carry the
        # hyperparameters (for lr schedulers); the state is in the swap files.
        self.placeholder = nn.Parameter(torch.empty(0), requires_grad=False)
        self.optimizer = CPUAdam([self.placeholder], adamw=True, **_adam_kwargs(cfg))
        self.out = torch.empty(self.group, dtype=dtype)  # a sub-group's new params
        self.steps = 0
        self.last_timings = StepTimings()
        self._loading: tuple[int, HostBuffer] | None = None
        log.info("NVMe optimizer state: %d sub-groups of %d params, %d host buffers of %.1f MiB",
                 len(self.bounds), self.group, self.swapper.pool.count, 12 * self.group / 2**20)

    @staticmethod
    def _group_size(sub_group_size: int, host_memory_limit: int | None, numel: int) -> int:
        """Params per sub-group: ``sub_group_size``, shrunk so three buffers fit the budget."""
        size = min(sub_group_size, numel)
        if host_memory_limit is not None:
            size = min(size, host_memory_limit // (NvmeAdam.BUFFERS * 12))
        return max(_PAGE_ELEMS, size // _PAGE_ELEMS * _PAGE_ELEMS)

    @staticmethod
    def _key(i: int) -> str:
        return f"adam.{i}"

    def load_state(self, offset: int, master: torch.Tensor, exp_avg: torch.Tensor | None = None,
                   exp_avg_sq: torch.Tensor | None = None) -> None:
        """Store state given in increasing, gap-free ``offset`` order (moments default to
        zeros); each sub-group is written as [master | m | v] once it is complete."""
        values = (master, exp_avg, exp_avg_sq)
        pos = 0
        while pos < master.numel():
            start = offset + pos
            i = start // self.group
            lo, hi = self.bounds[i]
            if self._loading is None:
                buf = self.swapper.pool.acquire(timeout=self.swapper.acquire_timeout)
                buf.view(torch.float32, (3, hi - lo))[1:].zero_()
                self._loading = (i, buf)
            buf = self._loading[1]
            take = min(hi - start, master.numel() - pos)
            state = buf.view(torch.float32, (3, hi - lo))
            for row, src in enumerate(values):
                if src is not None:
                    state[row, start - lo:start - lo + take].copy_(src[pos:pos + take])
            pos += take
            if start + take == hi:
                try:
                    self.swapper.swap_out(self._key(i), state.reshape(-1)).result()
                finally:
                    self.swapper.pool.release(buf)
                    self._loading = None

    def _timed(self, fut: Future, kind: str, timings: StepTimings) -> Future:
        """Add the request's duration (submit to completion) to ``timings`` when it ends."""
        start = time.perf_counter()

        def done(_: Future) -> None:
            setattr(timings, kind, getattr(timings, kind) + time.perf_counter() - start)
        fut.add_done_callback(done)
        return fut

    def _read(self, i: int, timings: StepTimings) -> Future:
        lo, hi = self.bounds[i]
        timings.bytes_read += 12 * (hi - lo)
        return self._timed(self.swapper.prefetch(self._key(i)), "read_s", timings)

    def update(self, grads32: torch.Tensor, sink: Sink) -> None:
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        self.steps += 1
        hyper = dict(step=self.steps, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                     eps=group["eps"], weight_decay=group["weight_decay"], adamw=True,
                     num_threads=self.optimizer.num_threads)
        timings = StepTimings()
        start = time.perf_counter()
        last = len(self.bounds) - 1
        lookahead = self.swapper.pool.count >= self.BUFFERS
        pending = self._read(0, timings)
        for i, (lo, hi) in enumerate(self.bounds):
            state = pending.result().view(3, hi - lo)
            if lookahead and i < last:
                pending = self._read(i + 1, timings)
            t0 = time.perf_counter()
            master, exp_avg, exp_avg_sq = state[0], state[1], state[2]
            out = None if self.out.dtype == torch.float32 else self.out[:hi - lo]
            adam_update(master, grads32[lo:hi], exp_avg, exp_avg_sq, out=out, **hyper)
            timings.compute_s += time.perf_counter() - t0
            sink(lo, hi, master if out is None else out)
            timings.bytes_written += 12 * (hi - lo)
            self._timed(self.swapper.swap_out(self._key(i), state.reshape(-1)), "write_s",
                        timings)
            if i > 0:
                self.swapper.release(self._key(i - 1))
            if not lookahead and i < last:
                self.swapper.release(self._key(i))
                pending = self._read(i + 1, timings)
        self.swapper.release(self._key(last))
        timings.wall_s = time.perf_counter() - start
        self.last_timings = timings
        self.optimizer.step()  # no tensors to update; tells lr schedulers that a step ran

    def iter_state(self) -> Iterator[StateChunk]:
        """Each sub-group read from its file (a pool buffer: used before the next is read)."""
        for i, (lo, hi) in enumerate(self.bounds):
            state = self.swapper.swap_in(self._key(i)).result().view(3, hi - lo)
            try:
                yield lo, hi, state[0], state[1], state[2]
            finally:
                self.swapper.release(self._key(i))

    def master_values(self) -> torch.Tensor:
        """A host copy of the fp32 master, read sub-group by sub-group from the files."""
        master = torch.empty(self.numel, dtype=torch.float32)
        for lo, hi, values, _, _ in self.iter_state():
            master[lo:hi].copy_(values)
        return master

    def add_to(self, report: MemoryReport) -> None:
        report.add("nvme", "optimizer", 12 * self.numel)
        report.add("host", "optimizer", self.swapper.host_buffer_nbytes + _nbytes(self.out))

    def close(self) -> None:
        self.swapper.close()


def make_updater(numel: int, cfg: ZeroConfig, device: torch.device, dtype: torch.dtype,
                 rank: int, param_shards: torch.Tensor | None = None,
                 host_memory_limit: int | None = None) -> Updater:
    """Build the updater ``offload_optimizer`` asks for, empty: fill it with ``load_state``.
    ``param_shards``: stage 3's rank-flat compute-dtype params when resident; a CPU updater
    writes them in place when they are in host memory. ``host_memory_limit``: this updater's
    share of the host budget (NVMe pool)."""
    where = cfg.offload.optimizer
    if where == "nvme":
        return NvmeAdam(numel, cfg, dtype, rank, host_memory_limit)
    out = param_shards if param_shards is not None and param_shards.device.type == "cpu" \
        and param_shards.dtype == dtype else None
    pin = where == "cpu" and torch.cuda.is_available()
    master = torch.empty(numel, dtype=torch.float32,
                         device="cpu" if where == "cpu" else device, pin_memory=pin)
    if where == "cpu":
        return HostAdam(master, cfg, dtype, out=out)
    if device.type == "cpu":
        return HostAdam(master, cfg, dtype, tier="device", out=out)
    return DeviceAdam(master, cfg)
