"""Reduced gradient shards on their way to an offloaded optimizer's host-side sum.

Stages 2–3 reduce a unit's gradients while backward still runs; with the optimizer offloaded
the reduced shard has to reach host memory (fp32, or files with gradients on NVMe). Doing that
inline would stop the backward twice: once for the device-to-host copy (a synchronizing copy
waits for every kernel queued before it) and once for the fp32 addition on the CPU. Here the
copy goes into a page-locked staging buffer on the device-to-host stream, and one worker
thread adds each piece to the target once its copy is done; backward waits only at its end
(:meth:`HostGradQueue.flush`), for the last pieces. On a CPU device the piece itself goes to
the worker (the reducer reuses its buffer only once the returned future is done). A failure
in the target (a full disk with gradients on NVMe) is raised by ``flush``, so
``engine.backward`` reports it.
"""

from __future__ import annotations

import functools
import logging
import queue
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch

from ..device.streams import Streams
from ..device.threads import ThreadBudget, yield_to_compute
from ..memory.ledger import MemoryReport
from ..policies import Stage
from ..swap.pinned import pinned_nbytes, unpin
from .target import GradTarget

__all__ = ["HostGradQueue", "STAGING_BUFFERS", "host_grad_dtype", "staging_bytes"]

log = logging.getLogger(__name__)

STAGING_BUFFERS = 3  # pieces in flight, each with a pinned staging buffer (CUDA)


def staging_bytes(largest_piece: int, dtype_bytes: int, depth: int = STAGING_BUFFERS) -> int:
    """Host bytes of the pinned staging buffers a CUDA device's queue holds (none on a CPU
    device): ``depth`` buffers of the largest reduced shard, in the compute dtype. They are
    taken from the host budget first."""
    return depth * largest_piece * dtype_bytes


def host_grad_dtype(stage: Stage, accumulation_steps: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype of an offloaded optimizer's host gradient shard. Where each element gets
    one reduced value per update (stages 0-1, where autograd sums the micro-steps on the
    device as torch does; stages 2-3 without accumulation) the compute dtype holds exactly
    what fp32 would, in half the bytes. Stages 2-3 sum micro-steps on the host: fp32, as
    DeepSpeed does (a shard that starts in the compute dtype widens itself when a second
    backward comes anyway: :class:`~.grads.ResidentGrads`)."""
    return torch.float32 if stage.shards_grads and accumulation_steps > 1 else dtype


class HostGradQueue:
    """A :class:`GradTarget` in front of a host-side target: pieces are copied and added
    in the background, in order; at most ``depth`` are in flight."""

    def __init__(
        self,
        target: GradTarget,
        streams: Streams,
        largest_piece: int,
        dtype: torch.dtype,
        depth: int = STAGING_BUFFERS,
        threads: ThreadBudget | None = None,
        worker: Executor | None = None,
    ) -> None:
        """``threads``: the rank's budget; on a CPU device the worker's sums yield to the
        backward's compute (:func:`~..device.threads.yield_to_compute`). ``worker``: runs the
        sums in order (a simulation runs them inline); None: a thread of this queue's own."""
        self.target = target
        self.streams = streams
        self.depth = depth
        self._pending: deque[Future] = deque()
        # On CUDA the worker makes the engine's GPU current first: a thread's first runtime
        # call would otherwise create a context on GPU 0 (in every rank).
        on_gpu = streams.device.type == "cuda"
        self._worker: Executor = worker or ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="zo-host-grads",
            initializer=functools.partial(torch.cuda.set_device, streams.device)
            if on_gpu
            else None
            if threads is None
            else functools.partial(yield_to_compute, threads),
        )
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._staging_bytes = self._pinned_bytes = 0
        self._staging: list[torch.Tensor] = []
        if streams.cuda:  # page-locked, so that the copy is asynchronous
            for _ in range(depth):
                buf = streams.host_empty(largest_piece, dtype)
                self._staging_bytes += buf.numel() * buf.element_size()
                self._pinned_bytes += pinned_nbytes(buf)
                self._staging.append(buf)
                self._free.put(buf)

    def accumulate_grad(self, offset: int, values: torch.Tensor, final: bool) -> Future[None]:
        """Queue the piece; the future is done once it is in the target (on a CPU device the
        worker reads ``values`` itself until then)."""
        while len(self._pending) >= self.depth:  # back-pressure: oldest piece first
            self._pending.popleft().result()
        if not self.streams.cuda:  # a CPU device: the piece is a fresh host tensor
            piece, copied, staging = values, None, None
        else:
            staging = self._free.get()
            piece = staging[: values.numel()]
            copied = self.streams.to_host(values, piece)
        added = self._worker.submit(self._add, offset, piece, final, copied, staging)
        self._pending.append(added)
        return added

    @property
    def added_bytes(self) -> int:
        """Bytes of pieces the target summed in (see ``ResidentGrads.added_bytes``)."""
        return getattr(self.target, "added_bytes", 0)

    @added_bytes.setter
    def added_bytes(self, value: int) -> None:
        if hasattr(self.target, "added_bytes"):
            self.target.added_bytes = value

    def region(self, offset: int, like: torch.Tensor) -> torch.Tensor | None:
        """On a CPU device, the target's zeroed region at ``offset`` (see
        :meth:`~.target.ResidentGrads.region`) for the caller to write in place: then there
        is nothing to copy or sum in the background. None with CUDA (the piece crosses
        PCIe through a staging buffer) or where the target lends none."""
        region = getattr(self.target, "region", None)
        return None if self.streams.cuda or region is None else region(offset, like)

    def _add(
        self,
        offset: int,
        piece: torch.Tensor,
        final: bool,
        copied: "torch.cuda.Event | None",
        staging: torch.Tensor | None,
    ) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            self.target.accumulate_grad(offset, piece, final)
        finally:
            if staging is not None:
                self._free.put(staging)

    def _wait(self) -> None:
        """Wait until every piece is in the target; raise the first failure."""
        error: BaseException | None = None
        while self._pending:
            try:
                self._pending.popleft().result()
            except BaseException as err:  # noqa: BLE001 - wait for the rest, raise the first
                error = error or err
        if error is not None:
            raise error

    def flush(self) -> None:
        """Every piece is in the target, and the target flushed; raise the first failure."""
        self._wait()
        self.target.flush()

    def zero_grad(self) -> None:
        """Drop the window. Pieces still queued belong to a backward that failed (a complete
        backward flushes): they are waited for and their errors dropped with them, since
        that backward raised its first failure already."""
        try:
            self._wait()
        except Exception as err:  # noqa: BLE001 - see above
            log.warning("zero_offload: dropped gradients of a failed backward: %s", err)
        self.target.zero_grad()

    def add_to(self, report: MemoryReport) -> None:
        if self._staging_bytes:
            report.add("host", "grads", self._staging_bytes, pinned=self._pinned_bytes)

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self._worker.shutdown(wait=True)
            for buf in self._staging:
                unpin(buf)
