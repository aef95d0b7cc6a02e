"""Which terms one configuration has: ``TermBuilder`` adds them group by group (parameters,
gradients, the unit being built, then the optimizer's, which ``optimizer_terms.OptimizerTerms``
adds), each size its owning component's sizing function or constant."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...grads.host import STAGING_BUFFERS
from ...grads.reducer import reductions_alive
from ...memory.sizes import pool_bytes as _pool
from ...optim.policy import StatePolicy
from ...params.sizing import param_host_numel
from ...params.units import unit_build_bytes
from ...policies import Stage, Tier
from .optimizer_terms import OptimizerTerms
from .state import moment_bytes, per_param_text, state_names
from .terms import (
    BUFFER,
    FORWARD_BACKWARD,
    INITIALIZE,
    MODEL_STATE,
    REDUCE,
    RESIDENT,
    STEP,
    HostSplit,
    Layout,
    Term,
)


@dataclass
class TermBuilder:
    """The terms of one configuration, added group by group in the order the table shows
    them; each group reads the choices, layout and host split held here."""

    num_params: int
    trainable_params: int  # Ψt
    sharding: Stage
    optimizer_tier: Tier
    param_tier: Tier
    device: str
    b: int  # bytes per element of the compute dtype
    shards: int  # ranks the params are sharded across (1 at stage 0)
    layout: Layout
    host: HostSplit
    gradient_accumulation_steps: int
    step_during_backward: bool = False  # the engine's keyword, where no clipping turns it off
    policy: StatePolicy = field(default_factory=StatePolicy)  # the optimizer state's bytes
    terms: list[Term] = field(default_factory=list)

    @property
    def T(self) -> str:
        """Ψt in the formulas: trainable params (written Ψ when all of them train)."""
        return "Ψ" if self.trainable_params == self.num_params else "Ψt"

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def grads_on_disk(self) -> bool:
        """With the optimizer on NVMe and an explicit budget too small for the fp32 shard,
        the gradients go to files beside the optimizer state."""
        return self.optimizer_tier.on_nvme and self.host.split.sizing.grads_on_disk

    def add(self, name: str, tier: str, phase: str, kind: str, nbytes: int, formula: str) -> None:
        self.terms.append(Term(name, tier, phase, kind, int(nbytes), formula))

    def add_params(self, prefetch_depth: int, offload_param_fraction: float | None) -> None:
        """Stages 0-2: a full copy per GPU. Stage 3: this rank's shards where offload_param
        puts them, the modules gathered around the running one, and NVMe's swap buffers."""
        b, lay = self.b, self.layout
        if not self.sharding.shards_params:
            self.add(
                "params",
                "device",
                RESIDENT,
                MODEL_STATE,
                b * lay.full,
                f"{b}Ψ: a full copy per GPU",
            )
            return
        self._add_param_shards(offload_param_fraction)
        self.add(
            "gathered params",
            "device",
            FORWARD_BACKWARD,
            BUFFER,
            lay.window * b,
            "the prefetch_depth + 1 largest modules",
        )
        if self.param_tier.on_nvme:
            self.add(
                "param swap buffers",
                "host",
                RESIDENT,
                BUFFER,
                _pool(
                    b * math.ceil(lay.largest / self.shards),
                    self.host.param_buffers,
                    self.host.param_budget,
                ),
                "(prefetch_depth + 2, + the units of an optimizer sub-group's step, at least 4, "
                "with the optimizer on NVMe) × largest module's shard, "
                "as the pool rounds it",
            )

    def _add_param_shards(self, offload_param_fraction: float | None) -> None:
        """Stage 3's parameter shards; on NVMe, the leading units' shards may stay in host
        memory (``offload_param_fraction``)."""
        b, lay = self.b, self.layout
        tier = self.param_tier
        fraction = offload_param_fraction if tier.on_nvme else None
        on_host = (
            param_host_numel([(p.shard_offset, p.shard_numel) for p in lay.plans], fraction)
            if lay.plans is not None
            else round((1.0 - fraction) * lay.s)
            if fraction is not None
            else 0
        )
        if tier.on_nvme and not on_host:  # each unit's shard a file of whole 4 KiB blocks
            self.add(
                "param shards",
                tier,
                RESIDENT,
                MODEL_STATE,
                lay.s_files,
                f"{b}Ψ/N, a file per unit in 4 KiB blocks",
            )
        else:
            self.add(
                "param shards",
                tier,
                RESIDENT,
                MODEL_STATE,
                b * (lay.s - on_host),
                f"{b}Ψ/N" if not on_host else f"{b} bytes × the units in files",
            )
        if on_host:
            self.add(
                "param shards (host part)",
                "host",
                RESIDENT,
                MODEL_STATE,
                b * on_host,
                f"{b} bytes × the leading units of Ψ/N, in host memory",
            )

    def add_grads(self) -> None:
        """Gradients, of the trainable params only: stages 0-1 hold autograd's full ones
        until reduced, stages 2-3 a shard; then the copies an offloaded optimizer needs."""
        b, lay, T = self.b, self.layout, self.T
        g_tier, g_bytes = (
            ("device", b)
            if not self.optimizer_tier.offloaded
            else (
                "host",
                4 if self.sharding.shards_grads and self.gradient_accumulation_steps > 1 else b,
            )
        )  # host_grad_dtype
        if self.grads_on_disk:
            g_tier = "nvme"
        if not self.sharding.shards_grads:
            self._add_unsharded_grads(g_tier, g_bytes)
        else:
            self.add(
                "grad shard", g_tier, RESIDENT, MODEL_STATE, g_bytes * lay.s_t, f"{g_bytes}{T}/N"
            )
            self.add(
                "grad reductions in flight",
                "device",
                FORWARD_BACKWARD,
                BUFFER,
                lay.inflight * b,
                f"the {reductions_alive()} largest {'units' if T == 'Ψ' else 'trainable units'}",
            )
        self._add_offload_copies()

    def _add_unsharded_grads(self, g_tier: str, g_bytes: int) -> None:
        """Stages 0-1: autograd's full gradients, reduced bucket by bucket into a shard."""
        b, lay, T, sharded, shards = self.b, self.layout, self.T, self.sharding.sharded, self.shards
        self.add(
            "grads",
            "device",
            REDUCE,
            MODEL_STATE,
            b * self.trainable_params,
            f"{b}{T}: autograd's full gradients until the step",
        )
        self.add(
            "reduced grad shard",
            g_tier,
            RESIDENT,
            BUFFER,
            g_bytes * lay.s_t,
            f"{g_bytes}{T}/N" if sharded else f"{g_bytes}{T}",
        )
        self.add(
            "grad bucket",
            "device",
            REDUCE,
            BUFFER,
            b * (lay.largest_t + (math.ceil(lay.largest_t / shards) if sharded else 0)),
            "one bucket flattened" + (" and its reduced shard" if sharded else ""),
        )

    def _add_offload_copies(self) -> None:
        """An offloaded optimizer's copies: gradients to the host, updated params back."""
        largest_t = self.layout.largest_t
        if not self.optimizer_tier.offloaded or self.on_cpu or not largest_t:
            return
        self.add(
            "grad staging",
            "host",
            RESIDENT,
            BUFFER,
            self.host.staging,
            f"{STAGING_BUFFERS} pinned buffers × the largest trainable unit's shard: "
            "device-to-host copies of reduced gradients",
        )
        if not self.sharding.shards_params:
            self.add(
                "updated params copied in",
                "device",
                STEP,
                BUFFER,
                self.b * math.ceil(largest_t / self.shards),
                "a unit's new shard, on its way to the all-gather",
            )

    def add_unit_being_made(self) -> None:
        """initialize() flattens one unit at a time where its values are (the host, for a
        model built on the meta device or the CPU) and moves it to the device once: its fp32
        values, the compute-dtype copy and this rank's fp32 shard. Adam's m and v and the
        gradient shard (counted as resident) are allocated only later, so they make room
        for it."""
        b, lay, T = self.b, self.layout, self.T
        making = unit_build_bytes(lay.largest, math.ceil(lay.largest / self.shards), b)
        moments = moment_bytes(self.policy, lay.s_t, self.host.split.rate)
        later = moments + b * lay.s_t if not self.optimizer_tier.offloaded else 0
        self.add(
            "unit being made",
            "device",
            INITIALIZE,
            BUFFER,
            max(0, making - later),
            f"(4{f' + {b}' if b != 4 else ''}) bytes × largest unit + 4 bytes × its shard"
            + (
                f", less {state_names(self.policy, master=False)} and the grad shard "
                f"({per_param_text(later / lay.s_t)}{T}/N, made later)"
                if later
                else ""
            ),
        )

    def add_optimizer(self) -> None:
        """The optimizer's state, its buffers and what stepping during backward adds."""
        self.terms += OptimizerTerms(
            policy=self.policy,
            tier=self.optimizer_tier,
            param_tier=self.param_tier,
            sharding=self.sharding,
            device=self.device,
            b=self.b,
            s_t=self.layout.s_t,
            T=self.T,
            split=self.host.split,
            step_during_backward=self.step_during_backward,
            grads_on_disk=self.grads_on_disk,
        ).terms()
