"""The host updater for every optimizer-state policy other than fp32 AdamW.

:class:`HostState` keeps this rank's run as one :class:`~zero_offload.optim.state.ShardState`
(master, compensation term, moments as values / absmax / side arrays; see
:mod:`zero_offload.optim.layout`) and steps the ranges a step names through
:func:`zero_offload.optim.step`, each with its own step count and weight decay. A range
ends where a parameter (or this rank's piece of one) does, and a parameter's first element
starts a quantization block, so every range owns whole blocks.

The default fp32 AdamW stays with :class:`~.updaters.HostAdam`, whose original kernel computes
what it always has. Checkpoints and ``engine.optimizer.state_dict()`` see this state as fp32
(:meth:`HostState.iter_state`: the master with its compensation added, each moment
dequantized); loading requantizes it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Mapping, Sequence

import torch
import torch.nn as nn

from ..config import ZeroConfig
from ..errors import CheckpointError, ConfigError
from ..memory.ledger import MemoryReport
from ..optim import CPUOptimizer, ShardState, StateLayout, StepHyper
from ..optim import step as optim_step
from ..optim.policy import MasterPrecision, StatePolicy
from ..params.units import UnitPlan
from ..swap.pinned import host_empty, pinned_nbytes, unpin
from .api import Sink, StateChunk, StepRange, StepTimings, Targets, whole_range
from .updater import Updater

__all__ = ["HostState", "SECTION_OF", "check_device", "run_layout"]

SECTION_OF = {"exp_avg": 1, "exp_avg_sq": 2, "sum": 2}
"""Where each moment goes among the (master, exp_avg, exp_avg_sq) fp32 sections that
checkpoints and state dicts hold: Lion's momentum as Adam's m, Adagrad's sum of squared
gradients as Adam's v; a section the kind does not have reads as zeros."""

GRAD_SLICE = 1 << 22  # gradients per call when they are on an accelerator
CHUNK = 1 << 24  # elements per fp32 piece that iter_state hands out


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class HostState(Updater):
    """Any :class:`~zero_offload.optim.policy.StatePolicy` in host memory, stepped by the CPU
    optimizer kernel. ``master``: an fp32 tensor to use as the master (the fp32 params when
    they are it), for a policy with an fp32 master; None: allocated here."""

    optimizer: CPUOptimizer

    def __init__(
        self,
        layout: StateLayout,
        cfg: ZeroConfig,
        dtype: torch.dtype,
        tier: str = "host",
        out: torch.Tensor | None = None,
        num_threads: int | None = None,
        master: torch.Tensor | None = None,
        crosses_pcie: bool = False,
    ) -> None:
        self.layout, self.policy, self.tier, self.dtype = layout, layout.policy, tier, dtype
        n = layout.numel
        fp32_master = self.policy.master is MasterPrecision.FP32
        if master is None or not fp32_master:
            master = host_empty(
                n, torch.float32 if fp32_master else torch.bfloat16, crosses_pcie=crosses_pcie
            )
        self.master = master
        self.compensation = (
            torch.zeros(n, dtype=torch.bfloat16)
            if self.policy.master is MasterPrecision.BF16_KAHAN
            else None
        )
        self._state: ShardState | None = None  # the moments come with the first need
        self.master_is_params = False
        o = cfg.optimizer
        self.param = nn.Parameter(master, requires_grad=False)
        self.optimizer = CPUOptimizer(
            [self.param],
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            optimizer_type=self.policy.kind.value,
            moment_precision=self.policy.moments.value,
            master_precision=self.policy.master.value,
            num_threads=num_threads,
        )
        self.steps = 0
        self.last_timings = StepTimings()
        # new compute-dtype values go here in the kernel's pass, unless the master is them
        self.owns_out = out is None and not (fp32_master and dtype == torch.float32)
        self.out = host_empty(n, dtype, crosses_pcie=True) if self.owns_out else out
        if fp32_master and dtype == torch.float32:
            self.out = None

    def state(self) -> ShardState:
        """The whole run's state (moments zero until loaded or stepped)."""
        if self._state is None:
            kept = {"master": self.master}
            if self.compensation is not None:
                kept["compensation"] = self.compensation
            self._state = ShardState.zeros(self.layout.span(), given=kept)
        return self._state

    def _master_fp32(self, lo: int, hi: int) -> torch.Tensor:
        m = self.master[lo:hi].float()
        if self.compensation is not None:
            m = m + self.compensation[lo:hi].float()
        return m

    def load_state(
        self,
        offset: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor | None = None,
        exp_avg_sq: torch.Tensor | None = None,
    ) -> None:
        """fp32 values of run elements [offset, offset + n): the master, and the moments in
        the sections of :data:`SECTION_OF` (rounded or quantized to this policy)."""
        end = offset + master.numel()
        if self.master[offset:end].data_ptr() != master.data_ptr():
            src = master.reshape(-1).float()
            self.master[offset:end].copy_(src)
            if self.compensation is not None:
                self.compensation[offset:end].copy_(src - self.master[offset:end].float())
        if exp_avg is None and exp_avg_sq is None:
            return
        sections = (None, exp_avg, exp_avg_sq)
        values = {
            name: sections[SECTION_OF[name]]
            for name in self.policy.moment_names
            if sections[SECTION_OF[name]] is not None
        }
        part = self.state().narrow(self.layout.span(offset, end))
        part.load_fp32(values)  # type: ignore[arg-type]

    def iter_state(self) -> Iterator[StateChunk]:
        """(lo, hi, master, exp_avg, exp_avg_sq) fp32 pieces, cut on block boundaries."""
        state, n, lo = self.state(), self.layout.numel, 0
        while lo < n:
            hi = self.layout.floor_boundary(lo + CHUNK) if lo + CHUNK < n else n
            hi = hi if hi > lo else min(n, lo + CHUNK)
            values = state.narrow(self.layout.span(lo, hi)).to_fp32()
            sections = [values["master"]] + [torch.zeros(hi - lo) for _ in range(2)]
            for name in self.policy.moment_names:
                sections[SECTION_OF[name]] = values[name]
            yield lo, hi, sections[0], sections[1], sections[2]
            lo = hi

    def update(
        self,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        ranges: list[StepRange] | None = None,
        targets: Targets | None = None,
    ) -> None:
        """Step ``ranges`` (each its own step count and weight decay) with ``grads ×
        factor``; the kernel writes the new compute-dtype values in the same pass; elements
        outside every range keep their state (their values are the master as it is)."""
        assert grads is not None
        start = time.perf_counter()
        state, n = self.state(), self.layout.numel
        step = self.steps + 1
        base = StepHyper.from_group(self.optimizer.param_groups[0], step, factor)
        per_call = None if grads.device.type == "cpu" else GRAD_SLICE
        done = 0
        for lo, hi, count, decays in whole_range(n, step) if ranges is None else ranges:
            lo, hi = max(lo, 0), min(hi, n)
            if lo >= hi:
                continue
            self._copy_master(done, lo)
            hyper = replace(base, step=count, weight_decay=base.weight_decay if decays else 0.0)
            a = lo
            while a < hi:
                b = hi if per_call is None else self._cut(a, hi, per_call)
                optim_step(
                    state.narrow(self.layout.span(a, b)),
                    grads[a:b].to("cpu"),
                    hyper,
                    out=None if self.out is None else self.out[a:b],
                    num_threads=self.optimizer.num_threads,
                )
                a = b
            done = hi
        self._copy_master(done, n)
        self.steps = step
        self.optimizer.step()  # no .grad: changes nothing; tells lr schedulers a step ran
        elapsed = time.perf_counter() - start
        self.last_timings = StepTimings(compute_s=elapsed, wall_s=elapsed)
        sink(0, n, self.master if self.out is None else self.out)

    def _cut(self, a: int, hi: int, per_call: int) -> int:
        if a + per_call >= hi:
            return hi
        b = self.layout.floor_boundary(a + per_call)
        return b if b > a else hi

    def _copy_master(self, a: int, b: int) -> None:
        """Elements [a, b) not stepped: their compute-dtype values are what the kernel would
        write from the master as it is."""
        if self.out is not None and a < b:
            self.out[a:b].copy_(self.param_values(a, b))

    def native_tensors(self) -> dict[str, torch.Tensor]:
        """The state as it is stored (codes, absmax, side arrays, bf16 master and its
        compensation), by ShardState name: what a checkpoint keeps to resume bit for bit."""
        return dict(self.state().tensors())

    def load_native(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`native_tensors` saved by a run of the same policy and layout."""
        restore_native(self.native_tensors(), tensors, self.policy)

    def param_values(self, lo: int, hi: int) -> torch.Tensor:
        """The compute-dtype values the kernel writes for run elements [lo, hi): a bf16
        master's own bits when the compute dtype is bf16, else the value it stands for."""
        if self.master.dtype == self.dtype:
            return self.master[lo:hi]
        return self._master_fp32(lo, hi)

    def master_values(self) -> torch.Tensor:
        """The fp32 master (a new tensor unless the master is fp32)."""
        if self.policy.master is MasterPrecision.FP32:
            return self.master
        return self._master_fp32(0, self.layout.numel)

    def resident_tensors(self) -> dict[str, torch.Tensor]:
        """The state tensors held in memory, by their names in a ShardState."""
        found = {"master": self.master}
        if self.compensation is not None:
            found["compensation"] = self.compensation
        if self._state is not None:
            found.update(dict(self._state.tensors()))
        return found

    def add_to(self, report: MemoryReport) -> None:
        held = sum(
            _nbytes(t)
            for name, t in self.resident_tensors().items()
            if not (name == "master" and self.master_is_params)
        )
        report.add(
            self.tier,
            "optimizer",
            held,
            pinned=0 if self.master_is_params else pinned_nbytes(self.master),
        )
        if self.owns_out:
            report.add(self.tier, "params", _nbytes(self.out), pinned=pinned_nbytes(self.out))

    def close(self) -> None:
        if not self.master_is_params:
            unpin(self.master)
        if self.owns_out:
            unpin(self.out)


def restore_native(
    mine: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], policy: StatePolicy
) -> None:
    """Copy the stored arrays ``tensors`` into this rank's ``mine`` (by ShardState name),
    refusing another policy's arrays or another layout's sizes before anything changes."""
    if set(tensors) != set(mine):
        raise CheckpointError(
            f"the stored optimizer state has arrays {sorted(tensors)}, "
            f"{policy.describe()} keeps {sorted(mine)}"
        )
    for name, t in mine.items():
        src = tensors[name]
        if src.dtype != t.dtype or src.numel() != t.numel():
            raise CheckpointError(
                f"the stored optimizer state {name!r} is {src.dtype} x {src.numel()}, "
                f"this rank keeps {t.dtype} x {t.numel()} (another layout)"
            )
    for name, t in mine.items():
        if t.data_ptr() != tensors[name].data_ptr():
            t.copy_(tensors[name].reshape(-1))


def run_layout(policy: StatePolicy, units: Sequence[UnitPlan], rank: int) -> StateLayout:
    """The layout of this rank's trainable run: each trainable unit's shard (the whole unit
    where it is not sharded) in rank-flat order."""
    trained = sorted((u for u in units if not u.frozen), key=lambda u: u.shard_offset)
    names = {n for u in trained for n in u.names}
    unknown = sorted(policy.fp32_moments - names)
    if unknown:
        raise ConfigError(
            f"fp32_moment_params names {unknown[:3]!r}, which are not trainable parameters "
            f"of the model; use names from model.named_parameters() (e.g. "
            f"{', '.join(sorted(names)[:5])})"
        )
    return StateLayout.for_shards(
        policy, [(u.layout, 0 if u.layout.num_shards == 1 else rank) for u in trained]
    )


def check_device(cfg: ZeroConfig, device: torch.device) -> None:
    """Any policy but fp32 AdamW is stepped by the CPU kernel: an optimizer left on an
    accelerator (no offload) is refused, naming the fix."""
    policy = cfg.optimizer.policy
    if not policy.is_default and not cfg.offload.optimizer_tier.offloaded and device.type != "cpu":
        raise ConfigError(
            f"optimizer_type / moment_precision / master_precision = {policy.describe()} is "
            f"stepped by the CPU optimizer kernel; with the optimizer on {device} pass "
            'offload_optimizer="cpu" (or keep fp32 AdamW on the device)'
        )
