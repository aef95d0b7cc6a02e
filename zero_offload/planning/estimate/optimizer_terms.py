"""The optimizer's terms: its state (master and moments, in device or host memory, or in
files with some sub-groups in host memory), the buffers it steps through (swap buffers,
the CPU Adam's output, torch's fp32 gradient slice) and, stepping during backward, the second
copy of the sub-groups it writes beside the old."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...optim.policy import MasterPrecision, StatePolicy
from ...params.sizing import shards_in_host_memory
from ...policies import Stage, Tier
from ...update.updaters import GRAD_SLICE
from .state import StateSplit, moment_bytes, per_param_text, state_names
from .terms import BUFFER, FORWARD_BACKWARD, MODEL_STATE, RESIDENT, STEP, Term

__all__ = ["OptimizerTerms"]


@dataclass
class OptimizerTerms:
    """The optimizer's part of one configuration's terms, from the choices it depends on."""

    policy: StatePolicy
    tier: Tier  # offload_optimizer's
    param_tier: Tier
    sharding: Stage
    device: str
    b: int  # bytes per element of the compute dtype
    s_t: int  # this rank's trainable shard
    T: str  # how the formulas write the trainable params
    split: StateSplit  # the state between host memory and files
    step_during_backward: bool
    grads_on_disk: bool
    _terms: list[Term] = field(default_factory=list, init=False, repr=False)

    def terms(self) -> list[Term]:
        """State, buffers, then what stepping during backward adds, as the table shows them."""
        self._terms = []
        self._add_state()
        self._add_buffers()
        self._add_early_update()
        return self._terms

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def _add(self, name: str, tier: str, phase: str, kind: str, nbytes: int, formula: str) -> None:
        self._terms.append(Term(name, tier, phase, kind, int(nbytes), formula))

    def _add_state(self) -> None:
        """The optimizer state (the policy's master and moments: fp32 master + Adam m + v
        by default), of the trainable params only (with the optimizer on NVMe, the leading
        sub-groups' state in host memory), and the fp32 gradient slice torch's fused AdamW
        steps from."""
        b, s_t, T, split, policy = self.b, self.s_t, self.T, self.split, self.policy
        if not self.tier.offloaded and b != 4 and not self.on_cpu:
            self._add(
                "fp32 grad slice",
                "device",
                STEP,
                BUFFER,
                4 * min(s_t, GRAD_SLICE),
                f"4 bytes × min({T}/N, {GRAD_SLICE}): torch's fused AdamW's fp32 gradients",
            )
        o_tier = self.tier
        on_nvme = split.nvme_numel if o_tier.on_nvme else s_t
        rate = split.rate
        per = per_param_text(rate)
        if self._params_are_master():
            self._add(
                "optimizer state",
                o_tier,
                RESIDENT,
                MODEL_STATE,
                moment_bytes(policy, s_t, rate),
                f"{per_param_text(rate - policy.master_bytes(1))}{T}/N: "
                f"{state_names(policy, master=False)} (the fp32 params are the master)",
            )
        else:
            self._add(
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
            self._add(
                "optimizer state (host part)",
                "host",
                RESIDENT,
                MODEL_STATE,
                split.host_state_bytes,
                f"{per} bytes × {1 - split.nvme_fraction:.0%} of {T}/N: "
                "whole sub-groups, in host memory",
            )

    @property
    def steps_in_backward(self) -> bool:
        """The engine steps sub-groups in files during the final backward
        (``update.nvme.early``): stages 2-3, the gradients in host memory."""
        return (
            self.step_during_backward
            and self.sharding.reduces_during_backward
            and self.tier.on_nvme
            and not self.grads_on_disk
        )

    def _add_early_update(self) -> None:
        """Stepping sub-groups in files during the final backward: their new state is
        written beside the old until ``step()`` adopts it, their new values to files of
        their own."""
        if not self.steps_in_backward:
            return
        on_nvme, T = self.split.nvme_numel, self.T
        self._add(
            "optimizer state stepped in backward",
            "nvme",
            FORWARD_BACKWARD,
            BUFFER,  # a second copy for a while, not more model state
            self.split.nvme_state_bytes,
            f"{per_param_text(self.split.rate)} bytes × the sub-groups in files "
            f"of {T}/N: beside the old until step()",
        )
        self._add(
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
            and not self.tier.offloaded
            and self.b == 4
            and (
                stage.all_reduces
                or stage.shards_params
                and (not param.offloaded or param.on_host and self.on_cpu)
            )
        )

    @property
    def _needs_out(self) -> bool:
        """The CPU optimizer writes compute-dtype params of its own unless an fp32 master is
        them (``update.host_state``, ``update.nvme.state``)."""
        return not (self.policy.master is MasterPrecision.FP32 and self.b == 4)

    def _add_buffers(self) -> None:
        """The NVMe optimizer's swap buffers, or the CPU Adam's compute-dtype output."""
        b, s_t, sizing = self.b, self.s_t, self.split.sizing
        if self.tier.on_nvme:
            count = sizing.buffers
            self._add(
                "optimizer swap buffers",
                "host",
                RESIDENT,
                BUFFER,
                self.split.pipeline_bytes,
                f"{count} sub-groups × {per_param_text(self.split.rate)} bytes, "
                "as the pool rounds them",
            )
            if self.grads_on_disk:
                self._add(
                    "grad swap buffers",
                    "host",
                    RESIDENT,
                    BUFFER,
                    sizing.grad_bytes(s_t),
                    f"{count} sub-groups × 4 bytes, as the pool rounds them",
                )
            if self._needs_out:
                self._add(
                    "param staging",
                    "host",
                    RESIDENT,
                    BUFFER,
                    b * sizing.group,
                    f"{b} bytes × one sub-group: CPU Adam's output",
                )
        elif self._needs_out and (self.tier.on_host or self.on_cpu):
            # The CPU Adam writes compute-dtype params into a buffer of its own unless stage
            # 3's shards are themselves in host memory.
            if not (
                self.sharding.shards_params and shards_in_host_memory(self.param_tier, self.device)
            ):
                tier = Tier.HOST if self.tier.on_host else Tier.DEVICE
                self._add(
                    "param staging",
                    tier,
                    RESIDENT,
                    BUFFER,
                    b * s_t,
                    f"{b}{self.T}/N: CPU Adam's output",
                )
