"""Where the optimizer state lives and how the AdamW update runs on it.

Three updaters share one face — ``update(grads, factor, sink)``: step the rank-flat state with
``grads × factor`` (the factor folds loss-scale and clipping into the one pass that reads the
gradients) and hand the new parameter values to ``sink`` — plus a torch ``optimizer`` whose
``param_groups`` carry the hyperparameters (lr schedulers drive it):

- :class:`DeviceAdam`: fp32 master, m, v on an accelerator; torch's fused AdamW.
- :class:`HostAdam` (``offload_optimizer="cpu"``, and the no-offload case when the compute
  device is the CPU): the state in host memory, updated by the vectorized CPU Adam, which also
  writes the compute-dtype params in the same pass, so only 2 bytes per parameter travel back
  to the device. Every CPU tier runs this same kernel, so offloading changes no bit.
- :class:`~.nvme.adam.NvmeAdam` (``offload_optimizer="nvme"``): the state in files, stepped as
  a pipeline over sub-groups (see its module).
- :class:`~.host_state.HostState`: any other optimizer kind or state precision, in host memory;
  :class:`~.nvme.state.NvmeState`: the same in files.

``update.factory.make_updater`` picks one for a run.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.optim.adamw import adamw as _functional_adamw

from ..config import ZeroConfig
from ..memory.ledger import MemoryReport
from ..optim import CPUAdam
from ..partition import chunks
from ..swap.pinned import host_empty, pinned_nbytes, unpin
from .api import (
    Sink,
    StateChunk,
    StepRange,
    StepTimings,
    Targets,
    adam_hyperparameters,
    adam_kwargs,
    whole_range,
)
from .range_step import adam_over_ranges
from .updater import Updater

__all__ = [
    "Updater",
    "StepTimings",
    "Sink",
    "StateChunk",
    "DeviceAdam",
    "HostAdam",
]

GRAD_SLICE = 1 << 22  # gradients per kernel call (they may be on a device, and widened)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


_CHUNK = 1 << 24  # elements per piece when state is streamed off an accelerator


class _ResidentAdam(Updater):
    """Master and moments as whole tensors in memory (device or host), with torch's
    optimizer-state layout: ``optimizer.state[param]`` holds step, exp_avg, exp_avg_sq."""

    tier = "device"

    def __init__(
        self, master: torch.Tensor, optimizer: torch.optim.Optimizer, param: nn.Parameter
    ) -> None:
        self.master, self.optimizer, self.param = master, optimizer, param
        self.last_timings = StepTimings()
        self.master_is_params = False  # the fp32 params themselves (their owner counts them)

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
            fused = self.optimizer.defaults.get("fused")
            state["step"] = torch.zeros(
                (), dtype=torch.float32, device=self.master.device if fused else "cpu"
            )
            state["exp_avg"] = torch.zeros_like(self.master)
            state["exp_avg_sq"] = torch.zeros_like(self.master)
        return state

    def load_state(
        self,
        offset: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor | None = None,
        exp_avg_sq: torch.Tensor | None = None,
    ) -> None:
        end = offset + master.numel()
        if self.master[offset:end].data_ptr() != master.data_ptr():  # not the params as they are
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
        for lo, hi in chunks(n, step):
            yield (
                lo,
                hi,
                self.master[lo:hi].cpu(),
                state["exp_avg"][lo:hi].cpu(),
                state["exp_avg_sq"][lo:hi].cpu(),
            )

    def master_values(self) -> torch.Tensor:
        return self.master

    def resident_tensors(self) -> dict[str, torch.Tensor]:
        """The state tensors held in memory, by role (for tools that attribute memory)."""
        state = self.optimizer.state.get(self.param, {})
        found = {
            "master": self.master,
            "exp_avg": state.get("exp_avg"),
            "exp_avg_sq": state.get("exp_avg_sq"),
        }
        return {k: v for k, v in found.items() if v is not None}

    def add_to(self, report: MemoryReport) -> None:
        state = self.optimizer.state.get(self.param, {})
        master = 0 if self.master_is_params else _nbytes(self.master)
        report.add(
            self.tier,
            "optimizer",
            master + _nbytes(state.get("exp_avg")) + _nbytes(state.get("exp_avg_sq")),
            pinned=0 if self.master_is_params else pinned_nbytes(self.master),
        )

    def close(self) -> None:
        if not self.master_is_params:
            unpin(self.master)


class DeviceAdam(_ResidentAdam):
    """fp32 master + AdamW state on an accelerator: torch's fused AdamW."""

    def __init__(
        self,
        master: torch.Tensor,
        cfg: ZeroConfig,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    ) -> None:
        """``make_optimizer``: builds the optimizer over the master (a simulation's stand-in
        for torch's fused AdamW, ``engine.runtime.Runtime``); None: torch's fused AdamW."""
        param = nn.Parameter(master, requires_grad=False)
        if make_optimizer is not None:
            optimizer = make_optimizer([param])
        else:
            try:
                optimizer = torch.optim.AdamW([param], fused=True, **adam_kwargs(cfg))
            except (RuntimeError, TypeError, ValueError):  # fused not supported here
                optimizer = torch.optim.AdamW([param], **adam_kwargs(cfg))
        super().__init__(master, optimizer, param)

    def update(
        self,
        grads: torch.Tensor | None,
        factor: float | torch.Tensor,
        sink: Sink,
        ranges: list[StepRange] | None = None,
        targets: Targets | None = None,
    ) -> None:
        """``factor`` may also be a device tensor. The gradients are widened to fp32 and
        scaled a slice at a time: a copy of the whole shard would be 4 bytes a parameter of
        device memory at every step. torch's AdamW is elementwise, so slices change no bit."""
        start = time.perf_counter()
        assert grads is not None
        step = self.steps + 1
        n = self.master.numel()
        widen = isinstance(factor, torch.Tensor) or factor != 1.0 or grads.dtype != torch.float32
        # one slice's fp32 copy, reused (the caller's gradients are never changed)
        slice32 = torch.empty(
            min(n, GRAD_SLICE) if widen else 0, dtype=torch.float32, device=grads.device
        )
        # the step count adamw increments, set again for each slice on its device (no sync)
        count = torch.empty((), dtype=torch.float32, device=self._moments()["step"].device)
        for lo, hi, steps, decays in whole_range(n, step) if ranges is None else ranges:
            for a in range(lo, hi, GRAD_SLICE):
                b = min(a + GRAD_SLICE, hi)
                piece = grads[a:b]
                if widen:
                    piece = slice32[: b - a].copy_(piece).mul_(factor)
                self._step_slice(a, b, piece, count.fill_(steps - 1), decays)
        self.steps = step
        self.optimizer.step()  # no .grad: changes nothing; tells lr schedulers a step ran
        elapsed = time.perf_counter() - start
        self.last_timings = StepTimings(compute_s=elapsed, wall_s=elapsed)
        sink(0, self.master.numel(), self.master)

    def _step_slice(
        self, lo: int, hi: int, grads32: torch.Tensor, count: torch.Tensor, decays: bool
    ) -> None:
        """torch's functional AdamW (fused where the optimizer is) on master[lo:hi], with
        ``count`` the steps before this one (parameters that missed updates have their own)
        and the slice's weight decay."""
        state = self._moments()
        group = self.optimizer.param_groups[0]
        _functional_adamw(
            [self.master[lo:hi]],
            [grads32],
            [state["exp_avg"][lo:hi]],
            [state["exp_avg_sq"][lo:hi]],
            [],
            [count],
            foreach=False,
            fused=bool(self.optimizer.defaults.get("fused")) or None,
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"] if decays else 0.0,
            eps=group["eps"],
            maximize=False,
        )


class HostAdam(_ResidentAdam):
    """fp32 master + AdamW state in host memory, stepped by the CPU Adam kernel. ``tier``
    names it in the ledger: "host" when offloaded, "device" when the CPU is the device."""

    def __init__(
        self,
        master: torch.Tensor,
        cfg: ZeroConfig,
        dtype: torch.dtype,
        tier: str = "host",
        out: torch.Tensor | None = None,
        num_threads: int | None = None,
    ) -> None:
        param = nn.Parameter(master, requires_grad=False)
        optimizer = CPUAdam([param], adamw=True, num_threads=num_threads, **adam_kwargs(cfg))
        super().__init__(master, optimizer, param)
        self.num_threads = num_threads
        self.tier = tier
        # The kernel writes the compute-dtype params into ``out`` in the same pass: the
        # caller's buffer when it lives in host memory (stage 3's param shards), else ours.
        self.owns_out = out is None and dtype != torch.float32
        self.out = host_empty(master.numel(), dtype, crosses_pcie=True) if self.owns_out else out
        if dtype == torch.float32:
            self.out = None

    def update(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        ranges: list[StepRange] | None = None,
        targets: Targets | None = None,
    ) -> None:
        """One pass of the CPU kernel over the gradients as they are (any float dtype): it
        widens them and multiplies them by ``factor`` in registers, so they are read once
        and never written; host gradients go to the kernel as one range per step range (it
        splits it among its threads). Elements outside ``ranges`` are left as they are
        (their compute-dtype copy is refreshed from the master)."""
        assert grads is not None
        start = time.perf_counter()
        state = self._moments()
        step = self.steps + 1
        adam_over_ranges(
            self.master,
            grads,
            state["exp_avg"],
            state["exp_avg_sq"],
            0,
            whole_range(self.master.numel(), step) if ranges is None else ranges,
            adam_hyperparameters(self.optimizer, step, self.num_threads),
            factor,
            out=self.out,
            # host gradients: one call per range; device ones copied a slice at a time
            chunk=None if grads.device.type == "cpu" else GRAD_SLICE,
        )
        self.steps = step
        self.optimizer.step()  # no .grad: changes nothing; tells lr schedulers a step ran
        elapsed = time.perf_counter() - start
        self.last_timings = StepTimings(compute_s=elapsed, wall_s=elapsed)
        sink(0, self.master.numel(), self.master if self.out is None else self.out)

    def add_to(self, report: MemoryReport) -> None:
        super().add_to(report)
        if self.owns_out:
            report.add(self.tier, "params", _nbytes(self.out), pinned=pinned_nbytes(self.out))

    def close(self) -> None:
        super().close()
        if self.owns_out:
            unpin(self.out)
