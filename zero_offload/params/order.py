"""Stage 3: every rank's forward must gather the same units in the same order.

A stage-3 gather is a collective, so a rank that runs a module the others skip (per-rank
routing, an early exit) would pair its gather with a different one on the other ranks: wrong
parameters, or a hang until the process group's timeout. Before each gather point of a forward
(a module about to run, a parameter gathered on demand) and at its end, the ranks exchange a
two-number tag saying what they are about to do. Equal tags: go on. Different tags: every rank
has the same tags in hand, so every rank raises the same error, naming what each rank runs,
before any mismatched collective is issued.

The tags travel over gloo on host memory, so checking costs the CUDA stream no sync: the
process group itself when it has a gloo backend, else a gloo group made for it (default group
only); a custom NCCL-only group falls back to tags on the device, one host sync per check.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from ..comm import Comm
from ..errors import DivergentForwardError

__all__ = ["OrderCheck", "DivergentForwardError", "MODULE", "UNIT", "END"]

log = logging.getLogger(__name__)

END, MODULE, UNIT = 0, 1, 2  # tag kinds: the forward ended, a module runs, a unit is gathered


def _channel(comm: Comm, device: torch.device) -> tuple[Comm, torch.device]:
    backend = str(dist.get_backend(comm.group))
    if "gloo" in backend or backend == "fake":  # fake: a rehearsal's ranks (host tags too)
        return Comm(comm.group), torch.device("cpu")
    if comm.group is None or comm.group == dist.group.WORLD:
        return Comm(dist.new_group(backend="gloo")), torch.device("cpu")
    log.info(
        "stage 3: the forward-order check runs on the %s group itself (a host sync "
        "per module); a gloo backend on it avoids that",
        backend,
    )
    return Comm(comm.group), device


class OrderCheck:
    """Compares every rank's next gather point (``check``) or end of forward (``end``);
    ``describe(kind, ident)`` names one for the error. Does nothing with one rank."""

    def __init__(
        self, comm: Comm, device: torch.device, describe: Callable[[int, int], str]
    ) -> None:
        self.world_size = comm.world_size
        self.describe = describe
        self.checks = 0
        if self.world_size > 1:
            self._comm, self._device = _channel(comm, device)

    def check(self, kind: int, ident: int) -> None:
        if self.world_size == 1:
            return
        self.checks += 1
        tag = torch.tensor([kind, ident], dtype=torch.int64, device=self._device)
        out = torch.empty(2 * self.world_size, dtype=torch.int64, device=self._device)
        self._comm.all_gather(out, tag)
        if is_fake(out):  # a rehearsal (fake ranks, fake tensors): no values to compare
            return
        tags = [tuple(t) for t in out.view(self.world_size, 2).tolist()]
        if any(t != tags[0] for t in tags):
            ranks = "; ".join(f"rank {r} {self.describe(*t)}" for r, t in enumerate(tags))
            raise DivergentForwardError(
                f"stage 3: the ranks' forwards diverged: {ranks}. Stage 3 gathers each "
                "module's parameters with a collective, so every rank must run the same "
                "modules in the same order (branches inside a module's forward that use the "
                "same parameters are fine). Run the skipped modules on every rank (e.g. on an "
                "empty or zero-weighted input), or use stage 1, which allows per-rank "
                "control flow"
            )

    def end(self) -> None:
        self.check(END, 0)
