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
so the caching allocator does not reuse its memory early. On a CPU device there are no
streams: every method does the same work inline and returns no event, so the code above
this module runs the same logic on both.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["Streams"]

Event = torch.cuda.Event


class Streams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.gather = torch.cuda.Stream(device) if self.cuda else None
        self._last_h2d: Event | None = None  # the newest host-to-device copy not waited for

    def _current(self) -> "torch.cuda.Stream":
        return torch.cuda.current_stream(self.device)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None, *,
                  own: bool = False) -> tuple[torch.Tensor, Event | None]:
        """``host`` (in ``dtype``) on the device, and the event after which it is there.
        ``host`` must stay unchanged until the event fires (page-locked for a true
        asynchronous copy). On a CPU device the result is ``host`` itself unless ``own``:
        then a copy, so that the caller may reuse ``host`` at once."""
        dtype = dtype or host.dtype
        if not self.cuda or host.device.type != "cpu":  # already where it is needed
            if host.dtype != dtype:
                return host.to(device=self.device, dtype=dtype), None
            return (host.clone() if own else host.to(self.device)), None
        if host.dtype != dtype:
            host = host.to(dtype)  # on the host: only the compute dtype crosses the link
        with torch.cuda.stream(self.h2d):
            out = torch.empty(host.shape, dtype=dtype, device=self.device)
            out.copy_(host, non_blocking=True)
            copied = Event(blocking=True)  # the host waits for it: sleeping, not spinning
            copied.record(self.h2d)
        self._last_h2d = copied
        return out, copied

    def to_host(self, values: torch.Tensor, out: torch.Tensor) -> Event | None:
        """Copy device ``values`` (produced by work queued on the compute stream so far) into
        the host tensor ``out`` (page-locked); done when the returned event fires."""
        if not self.cuda:
            out.copy_(values)
            return None
        assert self.d2h is not None
        self.d2h.wait_stream(self._current())
        with torch.cuda.stream(self.d2h):
            out.copy_(values, non_blocking=True)
            copied = Event(blocking=True)  # the host waits for it: sleeping, not spinning
            copied.record(self.d2h)
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
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def sync_h2d(self) -> None:
        """Block the host until every host-to-device copy issued so far is done: host
        memory they read may be overwritten afterwards."""
        if self._last_h2d is not None:
            self._last_h2d.synchronize()
            self._last_h2d = None
