"""Activation offload: tensors saved for backward go to host buffers during the forward and
come back, in reverse order and ahead of use, during the backward.

The forward runs under saved-tensor hooks. A saved tensor that is taken (:mod:`.select`: by
default the inputs activation checkpointing keeps, or every saved tensor; at least
``min_bytes``; never a parameter or a buffer) has its whole storage copied into a host
buffer (:mod:`.host_slots`) on the device-to-host stream, and autograd keeps a small handle
instead: once the forward drops its own references, the device memory is free. Several
tensors saved from one storage share one copy. At most ``prefetch`` copies are in flight: the
next one makes the compute stream wait (on the device) for the oldest, whose source is then
released. In backward, unpacking a handle brings its storage back on the host-to-device stream
(unless it is already on its way), hands autograd the same view of it (dtype, shape,
strides, offset: results are equal bit for bit), and starts bringing back the ``prefetch``
storages saved before it, which backward needs next. A storage's host buffer is given back
when autograd drops the last handle to it.

On a CPU device the copies run inline, into the same buffers, so the same code is exercised;
under a rehearsal (``zero_offload.rehearsal``) the simulated streams make the copies separate
tensors, so an offloaded tensor leaves the simulated device and counts as host bytes.

Stage 3 composes: its gatherer's own pack/unpack (``inner``) sees every saved tensor first and
keeps those that live in gathered parameters; only what it passes on is considered here.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from typing import Any, Callable, Iterator

import torch

from ..device.streams import Streams
from .config import ActivationConfig
from .host_slots import HostSlots
from .select import saved_by_checkpoint, storage_layout

__all__ = ["ActivationOffload"]

log = logging.getLogger(__name__)

_NONE_YET = 1 << 62  # no record considered yet in this pass
Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _Offloaded:
    """One device storage in a host buffer: where, in which dtype (its elements), its place
    in the forward's order, and the copies under way."""

    __slots__ = (
        "key",
        "slot",
        "nbytes",
        "dtype",
        "index",
        "storage",
        "copied",
        "ahead",
        "back",
        "handles",
        "__weakref__",
    )

    def __init__(self, slot: int, nbytes: int, dtype: torch.dtype, index: int, storage: Any):
        self.key = storage._cdata
        self.slot, self.nbytes, self.dtype, self.index = slot, nbytes, dtype, index
        self.storage = weakref.ref(storage)  # the device storage, while it lives
        self.copied: Any = None  # the device-to-host copy's event, until waited for
        self.ahead: tuple[torch.Tensor, Any] | None = None  # brought back ahead of use
        self.back: weakref.ref | None = None  # the device copy autograd was last handed
        self.handles = 0


class _Handle:
    """What autograd keeps for one saved tensor: the storage's record and the tensor's view."""

    __slots__ = ("owner", "record", "dtype", "size", "stride", "offset")

    def __init__(self, owner: "ActivationOffload", record: _Offloaded, t: torch.Tensor) -> None:
        self.owner, self.record = owner, record
        self.dtype, self.size, self.stride = t.dtype, t.size(), t.stride()
        self.offset = t.storage_offset()
        record.handles += 1

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.dtype != self.dtype:
            flat = flat.view(self.dtype)
        return flat.as_strided(self.size, self.stride, self.offset)

    def __del__(self) -> None:
        self.record.handles -= 1
        if self.record.handles == 0:
            self.owner._release(self.record)


class ActivationOffload:
    """Moves saved activations to host memory and back (see the module docstring).

    ``streams``: the device's (a rehearsal's simulated ones); ``host_limit``: bytes of host
    buffers allowed (the activations' share of the host budget); ``engine_storages()``: the
    storage keys of parameters and buffers, never offloaded; ``inner``: stage 3's saved-tensor
    hooks, consulted first."""

    def __init__(
        self,
        config: ActivationConfig,
        streams: Streams,
        host_limit: int,
        engine_storages: Callable[[], set[int]] = set,
        inner: Hooks | None = None,
    ) -> None:
        self.config = config
        self.streams = streams
        self.device = streams.device
        self.slots = HostSlots(streams.host_empty, host_limit)
        self._engine_storages = engine_storages
        self._owned: set[int] = set()
        self._inner = inner
        self._records: list[_Offloaded] = []  # this pass's, in the order they were saved
        self._by_storage: dict[int, _Offloaded] = {}  # device storage -> its live record
        self._in_flight: collections.deque = collections.deque()  # (source, event) of the forward
        self._ahead: list[_Offloaded] = []  # brought back, not yet unpacked
        self._cursor = _NONE_YET  # the next record to consider bringing back ahead
        self.host_bytes = 0  # bytes of device storages held in host buffers now
        self.peak_host_bytes = 0
        self.kept_bytes = 0  # bytes the last forward could not offload (no buffer room)
        self.offloaded = 0  # storages the last forward offloaded
        self.fetched_late = 0  # storages brought back only when unpacked, since the reset
        self._candidates = 0  # tensors of the last forward that passed the selection
        self._warned: set[str] = set()

    # -- the forward --------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The saved-tensor hooks of one forward; the copies still in flight at its end are
        waited for (on the device), so that the loss does not run beside their sources."""
        self._owned = self._engine_storages()
        self.kept_bytes = self.offloaded = self._candidates = 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._drain(0)
        self._check_found()

    def pack(self, tensor: torch.Tensor) -> Any:
        if self._inner is not None:
            packed = self._inner[0](tensor)
            if packed is not tensor:
                return packed  # a gathered parameter: stage 3 keeps it
        if not self._wanted(tensor):
            return tensor
        record = self._by_storage.get(_key(tensor))
        if record is not None and record.storage() is not tensor.untyped_storage():
            record = None  # a new storage where a freed one was
        if record is None:
            record = self._offload(tensor)
            if record is None:
                return tensor
        return _Handle(self, record, tensor)

    def _wanted(self, t: torch.Tensor) -> bool:
        if t.device != self.device or isinstance(t, torch.nn.Parameter):
            return False
        if t.numel() * t.element_size() < self.config.min_bytes:
            return False
        if self.config.mode == "checkpoints" and not saved_by_checkpoint():
            return False
        self._candidates += 1
        return bool(storage_layout(t)) and _key(t) not in self._owned

    def _offload(self, t: torch.Tensor) -> _Offloaded | None:
        nbytes = storage_layout(t)
        slot = self.slots.take(nbytes)
        if slot is None:
            self.kept_bytes += nbytes
            return None
        storage = t.untyped_storage()
        flat = t.as_strided((nbytes // t.element_size(),), (1,), 0)  # the whole storage
        record = _Offloaded(slot, nbytes, t.dtype, len(self._records), storage)
        record.copied = self.streams.to_host(
            flat, self.slots.view(slot, nbytes, t.dtype), record=False
        )
        self.slots.touched(slot, record.copied)
        self._records.append(record)
        self._by_storage[_key(t)] = record
        self.offloaded += 1
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        if record.copied is not None:
            self._in_flight.append((flat, record.copied))
            self._drain(self.config.prefetch)
        return record

    def _drain(self, keep: int) -> None:
        """Release the sources of all but ``keep`` copies in flight, the compute stream
        waiting for each copy first."""
        while len(self._in_flight) > keep:
            _, event = self._in_flight.popleft()
            self.streams.wait(event)

    # -- the backward -------------------------------------------------------------------------
    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return self._inner[1](packed) if self._inner is not None else packed
        record = packed.record
        flat = record.back() if record.back is not None else None
        if flat is None:
            if record.ahead is not None:
                flat, event = record.ahead
                record.ahead = None
                self._ahead.remove(record)
            else:
                flat, event = self._bring_back(record)
                self.fetched_late += 1
            self.streams.wait(event)
            self.streams.handed_over(flat)
            record.back = weakref.ref(flat)
        self._bring_ahead(record.index - 1)
        return packed.view_of(flat)

    def begin_backward(self) -> None:
        """Start bringing back the last storages the forward offloaded: the backward that is
        about to start needs them first."""
        self._bring_ahead(len(self._records) - 1)

    def _bring_back(self, record: _Offloaded) -> tuple[torch.Tensor, Any]:
        if record.copied is not None:
            record.copied.synchronize()  # the host buffer holds the values
            record.copied = None
        host = self.slots.view(record.slot, record.nbytes, record.dtype)
        flat, event = self.streams.to_device(host, own=True)
        self.slots.touched(record.slot, event)
        return flat, event

    def _bring_ahead(self, below: int) -> None:
        """Bring back, newest first, the storages saved before position ``below + 1`` that
        are still in host buffers, until ``prefetch`` are on their way."""
        self._cursor = min(self._cursor, below)
        while len(self._ahead) < self.config.prefetch and self._cursor >= 0:
            record = self._records[self._cursor]
            self._cursor -= 1
            back = record.back() if record.back is not None else None
            if record.handles and record.ahead is None and back is None:
                record.ahead = self._bring_back(record)
                self._ahead.append(record)

    def _release(self, record: _Offloaded) -> None:
        """Autograd dropped the last handle to ``record``'s storage: its buffer is free."""
        if record.ahead is not None:
            record.ahead = None
            self._ahead.remove(record)
        if self._by_storage.get(record.key) is record:
            del self._by_storage[record.key]
        self.host_bytes -= record.nbytes
        if self.slots.give_back(record.slot):  # nothing held: the next forward starts over
            self._records.clear()
            self._by_storage.clear()
            self._ahead.clear()
            self._cursor = _NONE_YET

    # -- reports ------------------------------------------------------------------------------
    def _check_found(self) -> None:
        if self.kept_bytes and "room" not in self._warned:
            self._warned.add("room")
            log.warning(
                "activation offload: the host buffers for activations are full (%.2f GiB, "
                "the activations' share of host_memory_limit); %.1f MiB of saved tensors "
                "stayed on the device in this forward. Raise host_memory_limit to offload "
                "them too",
                self.slots.limit / 2**30,
                self.kept_bytes / 2**20,
            )
        if (
            self.config.mode == "checkpoints"
            and not self._candidates
            and "none" not in self._warned
            and torch.is_grad_enabled()
        ):
            self._warned.add("none")
            log.warning(
                "offload_activations='checkpoints' found no input of an activation-checkpointed "
                "region of at least %d bytes in this forward: turn activation checkpointing on "
                "(model.gradient_checkpointing_enable(), torch.utils.checkpoint), or offload "
                "every saved tensor with offload_activations='all'",
                self.config.min_bytes,
            )

    def held_tensors(self) -> list[torch.Tensor]:
        """The host buffers and the device copies brought back ahead (what a rehearsal
        labels as activations)."""
        return list(self.slots.buffers) + [r.ahead[0] for r in self._ahead if r.ahead]

    def stats(self) -> dict[str, float]:
        return {
            "activations_offloaded_bytes": float(self.peak_host_bytes),
            "activations_kept_bytes": float(self.kept_bytes),
            "activations_fetched_late": float(self.fetched_late),
        }

    def reset_peak(self) -> None:
        self.peak_host_bytes = self.host_bytes
        self.fetched_late = 0

    def add_to(self, report: Any) -> None:
        report.add("host", "activations", self.slots.capacity, pinned=self.slots.pinned_bytes)

    def close(self) -> None:
        self._drain(0)
        self.slots.close()
