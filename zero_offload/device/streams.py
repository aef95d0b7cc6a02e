"""Side streams beside the compute stream, and the events that order work across them.

On CUDA three streams run next to the compute stream, so that data movement overlaps
computation instead of queueing behind it:

- ``h2d``: host-to-device copies (parameter shards from host memory or NVMe buffers, updated
  parameters after a CPU step). It waits for nothing: its targets are fresh tensors
  allocated on it, so a copy runs as soon as the PCIe link is free.
- ``d2h``: device-to-host copies of reduced gradient shards. It waits for the compute stream
  at the moment a copy is issued (the values come from work queued there).
- ``gather``: stage 3's all-gathers of modules ahead. It waits for the compute stream as it was
  when the gather is issued (before the running module's kernels), so a gather for module
  k + 1 overlaps module k's computation; the compute stream waits for the gather's event only
  right before it uses the parameters.

A tensor allocated on one stream and used on another is handed over with ``record_stream``
so the caching allocator does not reuse its memory early. Host memory on either end of a copy
is page-locked (``swap.pinned``), or ``non_blocking`` would silently be a synchronous copy: a
host tensor in another dtype is converted into a page-locked staging buffer, reused once the
copy that last read it is done. On a CPU device there are no
streams: every method does the same work inline and returns no event, so the code above
this module runs the same logic on both.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch

from ..swap.pinned import host_empty, unpin

__all__ = ["Streams"]

Event = torch.cuda.Event


class Fence(Protocol):
    """What the host can wait for: a CUDA event, or a rehearsal's stand-in for one."""

    def synchronize(self) -> None: ...


class Streams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.gather = torch.cuda.Stream(device) if self.cuda else None
        self._last_h2d: Fence | None = None  # the newest host-to-device copy not waited for
        self._convert: torch.Tensor | None = None  # page-locked staging for dtype conversions
        self._converted: Event | None = None  # the last copy that read ``_convert``

    def _current(self) -> "torch.cuda.Stream":
        return torch.cuda.current_stream(self.device)

    def to_device(
        self, host: torch.Tensor, dtype: torch.dtype | None = None, *, own: bool = False
    ) -> tuple[torch.Tensor, Event | None]:
        """``host`` (in ``dtype``) on the device, and the event after which it is there.
        ``host`` must stay unchanged until the event fires (page-locked for a true
        asynchronous copy). On a CPU device the result is ``host`` itself unless ``own``:
        then a copy, so that the caller may reuse ``host`` at once."""
        dtype = dtype or host.dtype
        if not self.cuda or host.device.type != "cpu":  # already where it is needed
            if host.dtype != dtype:
                return host.to(device=self.device, dtype=dtype), None
            return (host.clone() if own else host.to(self.device)), None
        host = self._converted_to(host, dtype)  # on the host: only the compute dtype crosses
        with torch.cuda.stream(self.h2d):
            out = torch.empty(host.shape, dtype=dtype, device=self.device)
            out.copy_(host, non_blocking=True)
        return out, self._record_h2d(host)

    def copy_into(self, target: torch.Tensor, values: torch.Tensor) -> Event | None:
        """Copy ``values`` into the existing device tensor ``target``. From the host the copy
        runs on the ``h2d`` stream after the work queued so far on the compute and gather
        streams (which may still read ``target``); ``values`` stays unchanged until the
        returned event fires (:meth:`sync_h2d` waits for it). Otherwise it runs inline."""
        if not self.cuda or values.device.type != "cpu" or target.device.type == "cpu":
            if target.data_ptr() != values.data_ptr():
                target.copy_(values)
            return None
        assert self.h2d is not None and self.gather is not None
        values = self._converted_to(values, target.dtype)
        self.h2d.wait_stream(self._current())
        self.h2d.wait_stream(self.gather)
        with torch.cuda.stream(self.h2d):
            target.copy_(values, non_blocking=True)
        return self._record_h2d(values)

    def _converted_to(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``host`` in ``dtype``, in page-locked memory when converted: the staging buffer,
        once the copy that read it last is done (grown to the largest request)."""
        if host.dtype == dtype:
            return host
        if (
            self._convert is None
            or self._convert.numel() < host.numel()
            or self._convert.dtype != dtype
        ):
            self._wait_converted()
            unpin(self._convert)
            self._convert = host_empty(host.numel(), dtype, crosses_pcie=True)
        self._wait_converted()
        return self._convert[: host.numel()].view(host.shape).copy_(host)

    def _wait_converted(self) -> None:
        if self._converted is not None:
            self._converted.synchronize()
            self._converted = None

    def _record_h2d(self, host: torch.Tensor) -> Event:
        copied = Event(blocking=True)  # the host waits for it: sleeping, not spinning
        copied.record(self.h2d)
        self._last_h2d = copied
        if self._convert is not None and host.data_ptr() == self._convert.data_ptr():
            self._converted = copied
        return copied

    def to_host(
        self, values: torch.Tensor, out: torch.Tensor, *, record: bool = True
    ) -> Event | None:
        """Copy device ``values`` (produced by work queued on the compute stream so far) into
        the host tensor ``out`` (page-locked); done when the returned event fires.
        ``record=False``: the caller keeps ``values`` alive until then and makes the compute
        stream :meth:`wait` for the event before dropping it (its memory is then reused at
        once, where the allocator would hold it until it sees the copy done)."""
        if not self.cuda:
            out.copy_(values)
            return None
        assert self.d2h is not None
        self.d2h.wait_stream(self._current())
        with torch.cuda.stream(self.d2h):
            out.copy_(values, non_blocking=True)
            copied = Event()
            copied.record(self.d2h)
        if record:
            values.record_stream(self.d2h)
        return copied

    def wait(self, event: Event | None) -> None:
        """Make the compute stream wait (on the device, not the host) for ``event``."""
        if event is not None:
            self._current().wait_event(event)

    def handed_over(self, tensor: torch.Tensor) -> None:
        """``tensor`` (allocated on a side stream) is now also used by the compute stream."""
        if self.cuda:
            tensor.record_stream(self._current())

    @contextlib.contextmanager
    def on_gather(self, after: Event | None) -> Iterator[None]:
        """Run the body on the gather stream, after the compute stream's work queued so far
        and after ``after`` (e.g. the shard's host-to-device copy)."""
        if not self.cuda:
            yield
            return
        assert self.gather is not None
        self.gather.wait_stream(self._current())
        if after is not None:
            self.gather.wait_event(after)
        with torch.cuda.stream(self.gather):
            yield

    def finish_gather(self, shard: torch.Tensor, full: torch.Tensor) -> Event | None:
        """Call inside :meth:`on_gather` once the all-gather of ``shard`` into ``full`` is
        queued (and the gather stream waits for it): ``shard`` is handed over to the gather
        stream, and the returned event fires when ``full`` is filled."""
        if not self.cuda:
            return None
        assert self.gather is not None
        shard.record_stream(self.gather)
        done = Event()
        done.record(self.gather)
        return done

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that copies to and from the device read or write asynchronously
        (page-locked with CUDA)."""
        return host_empty(numel, dtype, crosses_pcie=self.cuda)

    def sync_h2d(self) -> None:
        """Block the host until every host-to-device copy issued so far is done: host
        memory they read may be overwritten afterwards."""
        if self._last_h2d is not None:
            self._last_h2d.synchronize()
            self._last_h2d = None
            self._converted = None  # an earlier copy on the same stream

    def close(self) -> None:
        """Unpin the conversion staging buffer."""
        self.sync_h2d()
        unpin(self._convert)
