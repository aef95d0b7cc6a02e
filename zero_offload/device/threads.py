"""How many threads each kind of work of a rank gets, decided in one place.

A rank's CPU work comes in four kinds, and left alone each picks its own count — torch's
intra-op pool all physical cores of the machine, the CPU optimizer kernel as many again, the
disk engine its queue — so that on a node of 8 ranks the cores are asked for by some 8 × 3 ×
cores threads, and on one rank of a CPU device the update's Adam competes with the forward's
matrix products for the same two cores. :class:`ThreadBudget` decides them together:

- **cores**: the logical CPUs this process may run on (``os.sched_getaffinity``), divided
  among the ranks of the node (``LOCAL_WORLD_SIZE``) unless a launcher pinned this process to
  fewer CPUs than the machine has (then they are its own).
- **compute** (torch's intra-op threads: the forward and backward on a CPU device, the host
  side of a GPU's): torch's own setting, lowered to ``cores`` when it asks for more — never
  raised (a launcher's ``OMP_NUM_THREADS=1`` may be deliberate; the keyword raises it).
- **optimizer** (the CPU optimizer kernel when the step runs it alone): the physical cores
  among ``cores``; the kernel is memory-bound and SMT siblings share the bandwidth.
- **background** (the kernel while a forward or backward computes beside it: the pass during
  backward, ``step_during_backward``): on a CPU device the cores are the compute's, so one
  thread at a lower scheduling priority (:func:`yield_to_compute`): it takes what the compute
  leaves and the step waits for what it did not finish; on a GPU the host cores are free while
  the device computes, so ``optimizer`` threads less the one that launches the device's work,
  at normal priority.
- **io** (requests in flight per swap engine, each a thread that sleeps in ``preadv`` /
  ``pwritev``): set by the disk's queue, not by the cores (``swap.io.DEFAULT_QUEUE_DEPTH``).

The ``threads`` keyword overrides any of them: ``threads={"compute": 16, "optimizer": 8}``
(or an int: compute and optimizer both). ``engine.threads`` is the budget an engine runs with.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import psutil
import torch

from ..errors import ConfigError
from ..swap.io import DEFAULT_QUEUE_DEPTH

__all__ = ["ROLES", "BACKGROUND_NICE", "ThreadBudget", "check_threads", "yield_to_compute"]

log = logging.getLogger(__name__)

ROLES = ("compute", "optimizer", "background", "io")

BACKGROUND_NICE = 10
"""Niceness added to a background thread on a CPU device: a CFS weight of 110 against the
compute threads' 1024, so it runs in what they leave (and still runs: no starvation)."""


def check_threads(value: Any) -> None:
    """Raise :class:`ConfigError` unless ``value`` is None, a positive int, or a mapping of
    :data:`ROLES` to positive ints."""
    if value is None:
        return
    items = {"compute": value} if isinstance(value, int) else value
    if isinstance(value, bool) or not isinstance(items, Mapping):
        raise ConfigError(
            f"threads={value!r} is not valid: expected None, a positive int, or a mapping such "
            f"as {{'compute': 8, 'optimizer': 4}} with keys {', '.join(ROLES)}"
        )
    for role, n in items.items():
        if role not in ROLES:
            raise ConfigError(f"threads: unknown role {role!r}; the roles are {', '.join(ROLES)}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"threads[{role!r}]={n!r} is not valid: expected an int >= 1")


@dataclass(frozen=True)
class ThreadBudget:
    """Threads per kind of work of one rank (see the module docstring for the rule)."""

    cores: int
    compute: int
    optimizer: int
    background: int
    io: int
    background_nice: int  # added to a background thread's niceness (0: none)

    @classmethod
    def decide(
        cls,
        device_type: str,
        override: int | Mapping[str, int] | None = None,
        *,
        affinity: int | None = None,
        machine_cpus: int | None = None,
        physical_cpus: int | None = None,
        local_world_size: int | None = None,
        torch_threads: int | None = None,
    ) -> "ThreadBudget":
        """The budget of a rank computing on ``device_type``; the keywords after ``*`` stand
        for the machine (read from it when None)."""
        affinity = affinity if affinity is not None else len(_affinity())
        machine = machine_cpus or os.cpu_count() or affinity
        physical = physical_cpus or psutil.cpu_count(logical=False) or machine
        ranks = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        pinned = affinity < machine  # a launcher gave this process its own CPUs
        cores = max(1, affinity if pinned else affinity // max(1, ranks))
        per_core = max(1, round(machine / max(1, physical)))  # SMT siblings per core
        optimizer = max(1, cores // per_core)
        torch_now = torch_threads if torch_threads is not None else torch.get_num_threads()
        on_cpu = device_type == "cpu"
        chosen = {
            "compute": min(torch_now, cores),
            "optimizer": optimizer,
            # a GPU's host: one core stays for the thread that launches the device's work
            "background": 1 if on_cpu else max(1, optimizer - 1),
            "io": DEFAULT_QUEUE_DEPTH,
        }
        if isinstance(override, int):
            chosen.update(compute=override, optimizer=override)
        elif override is not None:
            chosen.update(override)
        return cls(
            cores=cores,
            background_nice=BACKGROUND_NICE if on_cpu else 0,
            **chosen,
        )

    def apply_compute(self) -> None:
        """Set torch's intra-op threads to :attr:`compute` (a process-wide setting: the last
        engine built decides)."""
        if torch.get_num_threads() != self.compute:
            log.info(
                "zero_offload: torch intra-op threads %d -> %d (%d cores for this rank)",
                torch.get_num_threads(),
                self.compute,
                self.cores,
            )
            torch.set_num_threads(self.compute)

    def describe(self) -> str:
        return (
            f"{self.cores} cores: compute {self.compute}, optimizer {self.optimizer}, "
            f"background {self.background}"
            + (f" (nice +{self.background_nice})" if self.background_nice else "")
            + f", io {self.io}"
        )


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def yield_to_compute(budget: ThreadBudget) -> None:
    """Lower the calling thread's scheduling priority by the budget's ``background_nice``
    (Linux: niceness is per thread; raising it needs no privilege). Elsewhere, or where the
    system refuses, nothing changes."""
    if not budget.background_nice or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + budget.background_nice
        )
    except OSError as err:
        log.debug("zero_offload: could not lower a background thread's priority: %s", err)
