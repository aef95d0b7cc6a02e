"""Which terms one configuration has: ``TermBuilder`` adds them group by group (parameters,
gradients, the unit being built, optimizer state and its buffers), each size its owning
component's sizing function or constant."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...grads.host import STAGING_BUFFERS
from ...grads.reducer import reductions_alive
from ...memory.sizes import pool_bytes as _pool
from ...optim.policy import MasterPrecision, StatePolicy
from ...params.store import param_host_numel, param_pool_buffers, shards_in_host_memory
from ...params.units import unit_build_bytes
from ...policies import Stage, Tier
from ...update.updaters import GRAD_SLICE
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
                    param_pool_buffers(prefetch_depth),
                    self.host.param_budget,
                ),
                "(prefetch_depth + 2) × largest module's shard, as the pool rounds it",
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

    def add_optimizer_state(self) -> None:
        """The optimizer state (the policy's master and moments: fp32 master + Adam m + v
        by default), of the trainable params only (with the optimizer on NVMe, the leading
        sub-groups' state in host memory), and the fp32 gradient slice torch's fused AdamW
        steps from."""
        b, s_t, T, split, policy = self.b, self.layout.s_t, self.T, self.host.split, self.policy
        if not self.optimizer_tier.offloaded and b != 4 and not self.on_cpu:
            self.add(
                "fp32 grad slice",
                "device",
                STEP,
                BUFFER,
                4 * min(s_t, GRAD_SLICE),
                f"4 bytes × min({T}/N, {GRAD_SLICE}): torch's fused AdamW's fp32 gradients",
            )
        o_tier = self.optimizer_tier
        on_nvme = split.nvme_numel if o_tier.on_nvme else s_t
        rate = split.rate
        per = per_param_text(rate)
        if self._params_are_master():
            self.add(
                "optimizer state",
                o_tier,
                RESIDENT,
                MODEL_STATE,
                moment_bytes(policy, s_t, rate),
                f"{per_param_text(rate - policy.master_bytes(1))}{T}/N: "
                f"{state_names(policy, master=False)} (the fp32 params are the master)",
            )
        else:
            self.add(
                "optimizer state",
                o_tier,
                RESIDENT,
                MODEL_STATE,
                split.state_bytes(on_nvme),
                f"{per}{T}/N: {state_names(policy)}"
                if on_nvme == s_t
                else f"{per} bytes × {split.nvme_fraction:.0%} of {T}/N: the sub-groups in files",
            )
        if on_nvme != s_t:
            self.add(
                "optimizer state (host part)",
                "host",
                RESIDENT,
                MODEL_STATE,
                split.host_state_bytes,
                f"{per} bytes × {1 - split.nvme_fraction:.0%} of {T}/N: "
                "the leading sub-groups, in host memory",
            )

    @property
    def steps_in_backward(self) -> bool:
        """The engine steps sub-groups in files during the final backward
        (``update.nvme.early``): stages 2-3, the gradients in host memory."""
        return (
            self.step_during_backward
            and self.sharding.reduces_during_backward
            and self.optimizer_tier.on_nvme
            and not self.grads_on_disk
        )

    def add_early_update(self) -> None:
        """Stepping sub-groups in files during the final backward: their new state is
        written beside the old until ``step()`` adopts it, their new values to files of
        their own."""
        if not self.steps_in_backward:
            return
        on_nvme, T = self.host.split.nvme_numel, self.T
        self.add(
            "optimizer state stepped in backward",
            "nvme",
            FORWARD_BACKWARD,
            BUFFER,  # a second copy for a while, not more model state
            self.host.split.nvme_state_bytes,
            f"{per_param_text(self.host.split.rate)} bytes × the sub-groups in files "
            f"of {T}/N: beside the old until step()",
        )
        self.add(
            "values stepped in backward",
            "nvme",
            FORWARD_BACKWARD,
            BUFFER,
            self.b * on_nvme,
            f"{self.b} bytes × the sub-groups in files of {T}/N: new params, written, read once",
        )

    def _params_are_master(self) -> bool:
        """fp32 params beside the optimizer are its master (updaters.make_updater), when the
        policy keeps an fp32 master."""
        stage, param = self.sharding, self.param_tier
        return (
            self.policy.master is MasterPrecision.FP32
            and not self.optimizer_tier.offloaded
            and self.b == 4
            and (
                stage.all_reduces
                or stage.shards_params
                and (not param.offloaded or param.on_host and self.on_cpu)
            )
        )

    def add_optimizer_buffers(self) -> None:
        """The NVMe optimizer's swap buffers, or the CPU Adam's compute-dtype output."""
        b, s_t, sizing = self.b, self.layout.s_t, self.host.split.sizing
        if self.optimizer_tier.on_nvme:
            count = sizing.buffers
            self.add(
                "optimizer swap buffers",
                "host",
                RESIDENT,
                BUFFER,
                self.host.split.pipeline_bytes,
                f"{count} sub-groups × {per_param_text(self.host.split.rate)} bytes, "
                "as the pool rounds them",
            )
            if self.grads_on_disk:
                self.add(
                    "grad swap buffers",
                    "host",
                    RESIDENT,
                    BUFFER,
                    sizing.grad_bytes(s_t),
                    f"{count} sub-groups × 4 bytes, as the pool rounds them",
                )
            if sizing.out_bytes(b):
                self.add(
                    "param staging",
                    "host",
                    RESIDENT,
                    BUFFER,
                    sizing.out_bytes(b),
                    f"{b} bytes × one sub-group: CPU Adam's output",
                )
        elif b != 4 and (self.optimizer_tier.on_host or self.on_cpu):
            # The CPU Adam writes compute-dtype params into a buffer of its own unless stage
            # 3's shards are themselves in host memory.
            if not (
                self.sharding.shards_params and shards_in_host_memory(self.param_tier, self.device)
            ):
                tier = Tier.HOST if self.optimizer_tier.on_host else Tier.DEVICE
                self.add(
                    "param staging",
                    tier,
                    RESIDENT,
                    BUFFER,
                    b * s_t,
                    f"{b}{self.T}/N: CPU Adam's output",
                )
