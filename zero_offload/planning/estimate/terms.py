"""What an estimate is made of: a ``Term`` (one buffer of one rank: its tier, when it is
alive, what it is), and the element counts (``Layout``) and host budget split
(``HostSplit``) that ``builder.TermBuilder`` reads to add a configuration's terms.

``memory.estimate_memory`` lays out the units and splits the host budget; the builder turns
those into terms. Neither this module nor the builder imports ``memory``, which re-exports
``Term`` and the phase and kind names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...params.units import UnitPlan
from .state import StateSplit

__all__ = [
    "Term",
    "Layout",
    "HostSplit",
    "RESIDENT",
    "FORWARD_BACKWARD",
    "LOSS",
    "REDUCE",
    "STEP",
    "INITIALIZE",
    "PHASES",
    "MODEL_STATE",
    "BUFFER",
    "ACTIVATIONS",
]

# When a term is alive.
RESIDENT = "resident"  # held between steps: what memory_report() shows after a step
FORWARD_BACKWARD = "forward/backward"  # only while the model runs
# the loss's log-softmax (the forward's end, the backward's start): the largest logits alive,
# but nothing of stage 3 gathered and no gradient reduced yet
LOSS = "loss"
REDUCE = "reduce"  # stages 0-1: autograd's gradients, from late in backward until reduced
STEP = "step"  # only inside engine.step(), once the gradients are reduced
INITIALIZE = "initialize"  # only inside initialize()
PHASES = (RESIDENT, FORWARD_BACKWARD, LOSS, REDUCE, STEP, INITIALIZE)
# What a term is.
MODEL_STATE = "model state"  # params, grads, optimizer state (ZeRO paper, Table 1)
BUFFER = "buffer"  # engine working memory on top of the model states
ACTIVATIONS = "activations"


@dataclass(frozen=True)
class Term:
    """One buffer (or group of buffers) of one rank."""

    name: str
    tier: str  # "device" (the GPU; the CPU when the engine runs on it), "host" or "nvme"
    phase: str  # one of PHASES
    kind: str  # MODEL_STATE, BUFFER or ACTIVATIONS
    bytes: int
    formula: str  # how it is computed, for people reading the table


@dataclass(frozen=True)
class Layout:
    """Element counts the terms are made of, from the engine's unit layout (a model) or from
    a parameter count (no padding)."""

    plans: list[UnitPlan] | None  # the engine's units; None for a parameter count
    full: int  # all the parameters, padded
    largest: int  # the largest unit (stage 3: module), flattened and gathered whole
    largest_t: int  # the largest trainable unit: what is reduced and stepped at once
    window: int  # what stage 3 gathers at a time
    inflight: int  # gradients being reduced at once (stages 2-3)
    s: int  # S: this rank's shard
    s_t: int  # its trainable prefix
    s_files: int  # bytes of the shard as files on NVMe


@dataclass(frozen=True)
class HostSplit:
    """The rank's host budget and how the engine splits it between its pools."""

    budget: int  # the whole of it (``swap.budget``)
    staging: int  # the device-to-host gradient staging buffers, taken first
    param_budget: int  # the NVMe parameter pool's share
    split: StateSplit  # the optimizer's state between host memory and files
    param_buffers: int = 0  # the NVMe parameter pool's buffers (``param_pool_buffers``)
