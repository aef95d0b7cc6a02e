"""One update of fp32 AdamW's NVMe sub-groups, as :class:`~.pipeline.SubGroupPipeline`
steps them: sub-group k's [master | m | v] is read into a pool buffer (the gradients too, where
they are in files), the CPU Adam steps it there, and the buffer is written back. A sub-group
stepped during backward (:mod:`.early`) is not stepped again: its new values are read and
handed on, and its new state file takes over."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from ...optim.policy import ADAM_STATE_BYTES
from ..api import Sink, StepRange, StepTimings, Targets
from .early import next_key, out_key
from .groups import AdamFiles
from .pipeline import Reads

__all__ = ["AdamStep"]


class AdamStep:
    """One update's sub-groups as :class:`~.pipeline.SubGroupPipeline` steps them: what to
    read, how the CPU Adam steps [master | m | v] where it was read, what to write back.
    ``replay``: sub-groups stepped during backward (:mod:`.early`), whose new state takes over
    as their new values are handed on."""

    def __init__(
        self,
        adam: AdamFiles,
        grads: torch.Tensor | None,
        factor: float,
        sink: Sink,
        hyper: dict,
        ranges: list[StepRange],
        targets: Targets | None,
        replay: set[int],
    ) -> None:
        self.adam, self.grads, self.factor, self.sink = adam, grads, factor, sink
        self.hyper, self.ranges, self.targets, self.replay = hyper, ranges, targets, replay

    def read_group(self, i: int, timings: StepTimings) -> Reads:
        """Sub-group i's state (None when in host memory) and gradients (None when in
        host memory); only its new values where it was stepped during backward."""
        adam, (lo, hi) = self.adam, self.adam.bounds[i]
        timed = adam.pipeline.io_clock.timed
        if i in self.replay:
            timings.bytes_read += adam.out_itemsize * (hi - lo)
            return timed(adam.swapper.prefetch(out_key(i)), "read_s", timings), None
        state = grad = None
        if not adam.on_host[i]:
            timings.bytes_read += ADAM_STATE_BYTES * (hi - lo)
            state = timed(adam.swapper.prefetch(adam.state_key(i)), "read_s", timings)
        if adam.disk_grads is not None:
            timings.bytes_read += adam.disk_grads.stored_bytes(i)
            grad = timed(adam.disk_grads.prefetch(i), "read_s", timings)
        return state, grad

    def step_group(self, i: int, got: list, timings: StepTimings) -> Future | None:
        adam, (lo, hi) = self.adam, self.adam.bounds[i]
        if i in self.replay:  # stepped during backward: hand on its new values
            adam.swapper.take_over(adam.state_key(i), next_key(i))  # raises: unchanged
            adam.pipeline.changing(i)  # from here on, its new state is the state
            adam.group_step.replay(got[0], lo, hi, self.sink, timings, self.targets)
            return None
        resident = adam.host_view(i)
        state = resident if resident is not None else got[0].view(3, hi - lo)
        if got[1] is not None:  # read from the gradient files
            grad = got[1]
        else:
            assert self.grads is not None  # not in files: the host shard was passed
            grad = self.grads[lo:hi]
        adam.pipeline.changing(i)  # from here on, sub-group i (and its gradients) change
        adam.group_step.step(
            state,
            grad,
            lo,
            hi,
            self.factor,
            self.ranges,
            self.hyper,
            self.sink,
            timings,
            self.targets,
        )
        if resident is not None:
            return None
        timings.bytes_written += ADAM_STATE_BYTES * (hi - lo)
        write = adam.swapper.swap_out(adam.state_key(i), state.reshape(-1))
        return adam.pipeline.io_clock.timed(write, "write_s", timings)

    def release_group(self, i: int) -> None:
        adam = self.adam
        if i in self.replay:
            adam.swapper.discard(out_key(i), at_once=False)  # read once
            return
        if not adam.on_host[i]:
            adam.swapper.release(adam.state_key(i))
        if adam.disk_grads is not None:
            adam.disk_grads.release(i)

    def drop_group(self, i: int, changed: bool) -> None:
        adam = self.adam
        if i in self.replay:  # the new state too, where it did not take over
            adam.swapper.discard(out_key(i))
            adam.swapper.discard(next_key(i))
        if not adam.on_host[i] and changed:
            adam.swapper.discard(adam.state_key(i))  # frees the disk too (ENOSPC)
        elif not adam.on_host[i]:
            adam.swapper.release(adam.state_key(i))
        if adam.disk_grads is not None:
            adam.disk_grads.release(i)
