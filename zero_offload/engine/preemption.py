"""``save_on_preemption``: SIGTERM (or SIGINT) ends a run with a checkpoint, on every rank.

A scheduler (SLURM, Kubernetes, torchrun) stops a job with SIGTERM, and the signal reaches
each rank at its own moment: one rank may be in a forward while another is in a collective
of the backward. A rank that stopped where it got the signal would leave the others waiting
in that collective. So the handler only records the signal; at each ``step()`` that ends an
accumulation window every rank contributes what it got to a one-integer all-reduce, and the
ranks stop together after that step — the update whole — at the same step count.

The engine then saves a checkpoint to the folder the keyword names and exits with the
status a process killed by the signal has (128 + its number), so the scheduler sees the
job end as it asked. With ``True`` the engine only agrees: ``engine.preempted`` names the
signal, and the caller saves (the Hugging Face Trainer and Lightning integrations save the
Trainer's own checkpoint folder, which their resume finds). A second signal before that
point acts as it would without the keyword (Ctrl-C twice stops at once).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable

import torch

from ..comm import Comm
from ..errors import ConfigError

__all__ = ["Preemption", "exit_status"]

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """A process killed by signal ``signum`` exits with this status (as shells report it)."""
    return 128 + signum


class Preemption:
    """The signal handlers and the agreement of the ranks at ``step()``."""

    def __init__(self, comm: Comm, device: torch.device) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "save_on_preemption installs SIGTERM/SIGINT handlers, which Python allows from "
                "the main thread only: call initialize() there, or drop save_on_preemption"
            )
        self._comm = comm
        self._device = device
        self.received = 0  # the signal this rank got (0: none)
        self.agreed = 0  # the signal the ranks stopped for, after a step() agreed on it
        self._previous: dict[int, Any] = {}
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:  # the second one: as without the keyword
            self._restore()
            signal.raise_signal(signum)
            return
        self.received = signum
        log.warning(
            "%s received: this step ends, then every rank saves a checkpoint and the run "
            "exits (send it again to stop at once)",
            signal.Signals(signum).name,
        )

    def stop_if_agreed(
        self,
        folder: object,
        save: Callable[[str], object],
        close: Callable[..., None],
    ) -> None:
        """Collective, after a step that ended a window: with the ranks agreed on a signal
        and ``folder`` (the keyword's value) a path, ``save`` a checkpoint there, ``close``
        the engine and exit with the signal's status."""
        signum = self.agree()
        if not signum or not isinstance(folder, str):
            return
        path = save(folder)
        log.warning("preempted: checkpoint saved at %s; exiting", path)
        close(hand_back=False)  # its files go now; the values are in the checkpoint
        raise SystemExit(exit_status(signum))

    def agree(self) -> int:
        """Collective, at the end of an accumulation window: the signal some rank got (the
        highest number when they differ), or 0 to go on."""
        flag = torch.tensor([self.received], dtype=torch.int64, device=self._device)
        self._comm.all_reduce(flag, op="max")
        self.agreed = int(flag.item())
        return self.agreed

    def take_back(self) -> None:
        """Handle the signals again where a framework installed its own handler over ours
        (``close`` puts back what was there before us)."""
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def close(self) -> None:
        """Put back the dispositions that were there (where nothing replaced ours since);
        not once the ranks agreed to stop: the process is on its way out with the signal's
        status, and a rank's own signal arriving after the agreement must not kill it. A
        signal received with no ``step()`` after it to act on (it came after the loop's last
        one) goes to the disposition put back, so the run still stops as it was asked."""
        if self.agreed:
            return
        self._restore()
        if self.received:
            signum, self.received = self.received, 0
            log.warning(
                "%s received and no step() followed to save a checkpoint: delivering it now",
                signal.Signals(signum).name,
            )
            signal.raise_signal(signum)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous, self._previous = self._previous, {}
        for sig, disposition in previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, disposition if disposition is not None else signal.SIG_DFL)
