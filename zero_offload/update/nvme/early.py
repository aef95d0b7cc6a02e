"""Stepping NVMe sub-groups during the final backward, beside the state they replace.

With the optimizer state on NVMe a step is disk-bound, and the backward is where the disk
has room: it reads only the parameter shards while the cores compute the gradients. Once the
reduction of a sub-group's last unit has landed in the host gradient shard, nothing changes
its gradients any more (unless a late piece of a reentrant backward arrives), so the sub-group
can be stepped there. The backward finishes the last units first, so the pass runs from the
top of the rank-flat shard down.

Nothing a forward or a checkpoint reads changes before ``step()``: a sub-group's new state
is written as ``adam.<i>.next`` beside ``adam.<i>``, its new compute-dtype values as
``adam.<i>.out``, and the parameter store is not touched. ``step()`` then either adopts the
pass — every sub-group it finished takes over its ``.next`` file (no data moves), and the
update reads those sub-groups' values instead of stepping them — or drops it, and the update
steps every sub-group as if no pass had run. It adopts only when the pass computed exactly
what the step would: the same hyperparameters, step counts and ranges (every parameter had a
gradient on some rank), gradient factor, and no late piece. So results are equal bit for bit
either way; a failed read or write, a full disk, ``zero_grad()``, another backward or
``close()`` drop the pass and cost nothing but the time it ran.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch

from ...device.threads import yield_to_compute
from ...swap.buffers import HostBuffer
from ..api import StepRange, StepTimings
from .groups import SubGroupFiles

__all__ = ["EarlyUpdate"]

log = logging.getLogger(__name__)


def next_key(i: int) -> str:
    return f"adam.{i}.next"


def out_key(i: int) -> str:
    return f"adam.{i}.out"


class EarlyUpdate:
    """One final backward's pass over the sub-groups whose gradients are complete, run by a
    thread of its own. :meth:`landed` tells it which rank-flat elements are; :meth:`adopt`
    (the step) or :meth:`drop` ends it."""

    def __init__(
        self,
        adam: SubGroupFiles,
        grads: torch.Tensor,
        factor: float,
        hyper: dict,
        ranges: list[StepRange],
        unit_starts: list[int],
    ) -> None:
        """``unit_starts``: the rank-flat start of each stepped unit, in rank-flat order
        (:meth:`landed` names a unit by its position there)."""
        self.adam = adam
        self.grads = grads
        self.factor = factor
        self.hyper = hyper
        # the kernel beside the backward: its results do not depend on how many threads
        # split it, and on a CPU device the cores are the backward's (device.threads)
        self._background = dict(hyper, num_threads=adam.threads.background)
        self.ranges = ranges
        self.steps = adam.steps  # the step count it builds on
        self._version = grads._version  # of the sums it read: any later change drops it
        self.timings = StepTimings()
        self._starts = unit_starts
        self._landed = [False] * len(unit_starts)
        self._ready_from = adam.numel  # rank-flat [ready_from, numel) has landed
        self._cond = threading.Condition()
        self._stop = False
        self._late = False
        self._waiting_for: int | None = None  # the rank-flat start the pass waits to be ready
        self._finished = False  # the thread has ended
        self.done: list[int] = []  # sub-groups stepped, both files written
        self._started: list[int] = []  # sub-groups whose files it may have begun
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zo-early-update", daemon=True)
        self._thread.start()

    # -- the backward's side ----------------------------------------------------------------
    def landed(self, k: int) -> None:
        """The reduced gradients of stepped unit ``k`` are in the host shard (a worker
        thread may call this)."""
        with self._cond:
            if self._landed[k]:  # reduced twice in one backward: a late piece
                self._late = self._stop = True  # the step reduces it and steps every sub-group
                self._cond.notify_all()
                return
            self._landed[k] = True
            self._version = self.grads._version  # the sums as they landed
            j = len(self._landed)
            while j > 0 and self._landed[j - 1]:
                j -= 1
            self._ready_from = self._starts[j] if j < len(self._starts) else self.adam.numel
            self._cond.notify_all()

    # -- the pass -------------------------------------------------------------------------
    def _wait_ready(self, lo: int) -> bool:
        with self._cond:
            self._waiting_for = lo
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._stop or self._ready_from <= lo)
            self._waiting_for = None
            return not self._stop

    def wait_idle(self) -> None:
        """Wait until every sub-group ready so far is stepped (or the pass ended)."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._finished
                    or self._waiting_for is not None
                    and self._ready_from > self._waiting_for
                )
            )

    def _run(self) -> None:
        adam, swapper = self.adam, self.adam.swapper
        yield_to_compute(adam.threads)  # the backward's compute first (device.threads)
        todo = [i for i in reversed(range(len(adam.bounds))) if not adam.on_host[i]]
        ahead: tuple[int, Future] | None = None  # a read started before its turn
        try:
            for n, i in enumerate(todo):
                lo, hi = adam.bounds[i]
                if not self._wait_ready(lo):
                    break
                if ahead is None:
                    ahead = (i, swapper.prefetch(adam.state_key(i)))
                state = ahead[1].result().view(3, hi - lo)
                ahead = None
                buf: HostBuffer | None = swapper.take_buffer(adam.state_key(i))
                self._started.append(i)
                try:
                    if n + 1 < len(todo) and swapper.pool.count >= adam.BUFFERS:
                        j = todo[n + 1]
                        if self._ready_from <= adam.bounds[j][0]:
                            ahead = (j, swapper.prefetch(adam.state_key(j)))
                    written: list[Future] = []

                    def write_out(
                        p: int, q: int, values: torch.Tensor, i: int = i, written: list = written
                    ) -> None:  # from where they are: the next sub-group waits for it
                        written.append(swapper.swap_out(out_key(i), values))

                    adam.group_step.step(
                        state,
                        self.grads[lo:hi],
                        lo,
                        hi,
                        self.factor,
                        self.ranges,
                        self._background,
                        write_out,
                        self.timings,
                        None,
                    )
                    owned, buf = buf, None  # the swapper gives it back once written
                    written.append(swapper.swap_out(next_key(i), state.reshape(-1), owned=owned))
                    for w in written:
                        w.result()
                finally:
                    if buf is not None:
                        swapper.pool.release(buf)
                self.done.append(i)
        except BaseException as err:  # noqa: BLE001 - the step sees it and drops the pass
            self.error = err
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()
            if ahead is not None:
                try:
                    ahead[1].result()
                except BaseException:  # noqa: BLE001 - a read ahead nobody needs
                    pass
                swapper.release(adam.state_key(ahead[0]))

    def _finish(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self.adam.early_ended(self)

    # -- the step's side --------------------------------------------------------------------
    def check(
        self, grads: torch.Tensor | None, hyper: dict, ranges: list[StepRange], factor: float
    ) -> list[int]:
        """Stop the pass. If it computed what the step computes, the sub-groups it finished
        (in rank-flat order), whose ``.next`` files then take over their state (the caller
        does that: it is where the state changes); otherwise it is dropped: none."""
        self._finish()
        why = self._mismatch(grads, hyper, ranges, factor)
        if why:
            if self.done:
                log.info("dropping %d sub-groups stepped during backward: %s", len(self.done), why)
            self._discard()
            return []
        return sorted(self.done)

    def _mismatch(
        self, grads: torch.Tensor | None, hyper: dict, ranges: list[StepRange], factor: float
    ) -> str:
        if self.error is not None:
            return f"it failed ({type(self.error).__name__}: {self.error})"
        if self._late:
            return "gradients arrived after their unit was reduced"
        if grads is not self.grads:
            return "the gradient shard was replaced (a second backward summed into fp32)"
        if grads._version != self._version:
            return "the gradients changed after they were reduced"
        if self.adam.steps != self.steps:
            return "the step count changed"
        if hyper != self.hyper:
            return "the hyperparameters changed"
        if ranges != self.ranges:
            return "some parameter had no gradient"
        if factor != self.factor:
            return "the gradient factor changed"
        return ""

    def drop(self) -> None:
        """Stop the pass and delete what it wrote (the gradients it read are gone)."""
        self._finish()
        self._discard()

    def _discard(self) -> None:
        swapper = self.adam.swapper
        for i in self._started:
            for key in (next_key(i), out_key(i)):
                try:
                    swapper.discard(key)
                except OSError as err:  # the disk may be gone; the files go at close
                    log.warning("dropping a sub-group stepped during backward: %s", err)
        self.done, self._started = [], []
