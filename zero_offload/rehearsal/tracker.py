"""Count what a run under fake tensors would allocate on the device and on the host.

:class:`MemoryTracker` is a dispatch mode stacked above ``FakeTensorMode``: every operation's
output storages are registered (weakly, so a freed tensor stops counting) and the live ones are
summed per device — what ``torch.cuda.memory_allocated`` would say, without the caching
allocator's rounding. A storage's size is re-read whenever an operation touches it (the engine
resizes a stage-3 unit's storage in place to gather it); frees are seen by a full re-read,
done whenever the live bytes may have passed the phase's peak. When a phase reaches a new
peak, the live bytes are broken down by kind (parameters, gathered units, gradients, ...): by
who holds the storage when the engine can say (``identify``), else by the engine module that
allocated it, else by phase (forward/backward: activations).

What a kernel allocates and frees inside itself (a fused attention backward's fp32
accumulators) is not an operation's output; ``scratch(func, args)`` gives its bytes, held as
a device storage while the operation runs.

Scalar reads (``.item()``) have no value under fake tensors; they read 0 (True for a flag),
so norms read 0 and no overflow is seen: values are not simulated, only sizes.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "MemoryTracker",
    "PhaseMemory",
    "KINDS",
    "PARAMS",
    "GATHERED",
    "GRADS",
    "OPTIMIZER",
    "ACTIVATIONS",
    "COMM",
    "OTHER",
]

PARAMS = "params"
GATHERED = "gathered units"
GRADS = "grads"
OPTIMIZER = "optimizer state"
ACTIVATIONS = "activations"
COMM = "comm buffers"
OTHER = "other"
KINDS = (PARAMS, GATHERED, GRADS, OPTIMIZER, ACTIVATIONS, COMM, OTHER)

# The engine module that allocates a storage says what it is (the innermost one on the stack;
# a torch-function mode the model's calls pass through says nothing).
_MODULE_KINDS = {
    "zero_offload.comm": COMM,
    "zero_offload.grads.reducer": COMM,
    "zero_offload.grads.host": COMM,
    "zero_offload.device.streams": COMM,
    "zero_offload.params.units": PARAMS,
    "zero_offload.params.store": PARAMS,
    "zero_offload.params.gather": GATHERED,
    "zero_offload.update.stepper": OPTIMIZER,
    "zero_offload.update.grad_prep": OPTIMIZER,
    "zero_offload.update.api": OPTIMIZER,
    "zero_offload.params.order": COMM,
    "zero_offload.update.updaters": OPTIMIZER,
    "zero_offload.update.factory": OPTIMIZER,
    "zero_offload.update.nvme.adam": OPTIMIZER,
    "zero_offload.optim.native.adam_kernel": OPTIMIZER,
    "zero_offload.optim.cpu_adam": OPTIMIZER,
    "zero_offload.rehearsal.simulate": COMM,  # host-device copies through the streams
    "zero_offload.engine.engine": None,  # the model runs under it: decided by the phase
    "zero_offload.engine.forward": None,  # the engine's forward calls: the same
}
# ...except a gradient copy made inside an optimizer's update (the fp32 gradients of a step)
_FUNCTION_KINDS = {("zero_offload.update.updaters", "update"): GRADS}
_RUNNING = ("forward", "backward")  # phases in which unattributed memory is activations
_SNAPSHOT_STEP = 1e-3  # a new breakdown once the peak grew by this fraction
_COPIES = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)
_DEVICE = torch.ops.prim.device.default


def _fakes(values: tuple | list, found: list | None = None) -> list:
    """The fake tensors among an operation's outputs and arguments (nested in lists and
    tuples, as aten passes them): a plain walk, several times faster than pytree's."""
    found = [] if found is None else found
    for v in values:
        if isinstance(v, FakeTensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            _fakes(v, found)
    return found


@dataclass
class PhaseMemory:
    """Peak bytes of one phase on the device and the host, and what made them."""

    device_peak: int = 0
    host_peak: int = 0
    device_end: int = 0  # live when the phase ended
    host_end: int = 0
    device_kinds: dict[str, int] = field(default_factory=dict)  # at (within 0.1% of) the peak
    host_kinds: dict[str, int] = field(default_factory=dict)
    # the most activations seen at any of the phase's successive peaks (the loss's moment,
    # then a layer's): what the activation figures of the planner are compared with
    activations_peak: int = 0
    h2d_bytes: int = 0  # copies host -> device
    d2h_bytes: int = 0
    nvme_peak: int = 0  # bytes in the (simulated) swap files; 0 without NVMe
    nvme_end: int = 0
    nvme_read: int = 0
    nvme_written: int = 0
    flops: int = 0  # FLOPs of the operations the phase ran (torch's FlopCounterMode)

    def merge(self, other: "PhaseMemory") -> None:
        """Keep the larger peak (and its breakdown) of two runs of the same phase."""
        if other.device_peak > self.device_peak:
            self.device_peak, self.device_kinds = other.device_peak, other.device_kinds
        if other.host_peak > self.host_peak:
            self.host_peak, self.host_kinds = other.host_peak, other.host_kinds
        self.device_end, self.host_end = other.device_end, other.host_end
        self.activations_peak = max(self.activations_peak, other.activations_peak)
        self.h2d_bytes = max(self.h2d_bytes, other.h2d_bytes)
        self.d2h_bytes = max(self.d2h_bytes, other.d2h_bytes)
        self.nvme_peak = max(self.nvme_peak, other.nvme_peak)
        self.nvme_end = other.nvme_end
        self.nvme_read = max(self.nvme_read, other.nvme_read)
        self.nvme_written = max(self.nvme_written, other.nvme_written)
        self.flops = max(self.flops, other.flops)


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes per device of the fake tensors made while it is active.
    ``device_type``: the simulated accelerator's device type; everything on ``cpu`` is host.
    ``disk``: the simulated NVMe tier (a :class:`~.disk.SimulatedDisk`), when there is one.
    ``scratch``: (operation, arguments) -> device bytes the kernel uses inside itself."""

    def __init__(
        self,
        device_type: str,
        identify: Callable[[], dict[int, str]] | None = None,
        disk: Any = None,
        scratch: Callable[[Any, tuple], int] | None = None,
    ) -> None:
        super().__init__()
        self.disk = disk
        self.scratch = scratch
        self._disk_io = (0, 0)  # the disk's (read, written) when the phase began
        self.device_type = device_type
        self.identify = identify or dict
        self._live: dict[int, list] = {}  # key -> [weakref, on device, kind, nbytes seen]
        self.phase = "initialize"
        self.phases: dict[str, PhaseMemory] = {}
        self._current = PhaseMemory()
        self._device_now = self._host_now = 0
        # upper bounds of the live bytes since the last scan: frees are only seen by a scan,
        # growth at once, so a scan is needed only when a bound passes the phase's peak
        self._device_bound = self._host_bound = 0
        self._snap_device = self._snap_host = 0

    # -- phases ---------------------------------------------------------------------------
    def begin(self, phase: str) -> None:
        self.phase = phase
        self._scan()
        self._current = PhaseMemory(device_peak=self._device_now, host_peak=self._host_now)
        self._snap_device = self._snap_host = -1
        self._snapshot(device=True, host=True)
        if self.disk is not None:
            self.disk.reset_peak()
            self._disk_io = (self.disk.read, self.disk.written)

    def add_flops(self, flops: int) -> None:
        """FLOPs the current phase ran, counted by the caller."""
        self._current.flops += int(flops)

    def end(self) -> PhaseMemory:
        self._scan()
        cur = self._current
        cur.device_end, cur.host_end = self._device_now, self._host_now
        if self.disk is not None:
            cur.nvme_peak, cur.nvme_end = self.disk.peak, self.disk.live
            cur.nvme_read = self.disk.read - self._disk_io[0]
            cur.nvme_written = self.disk.written - self._disk_io[1]
        if self.phase in self.phases:
            self.phases[self.phase].merge(cur)
        else:
            self.phases[self.phase] = cur
        return cur

    def tag(self, tensor: torch.Tensor, kind: str) -> None:
        """Say what ``tensor``'s storage is (e.g. a transfer buffer), overriding the guess."""
        entry = self._live.get(tensor.untyped_storage()._cdata)
        if entry is not None:
            entry[2] = kind

    def live_bytes(self) -> tuple[int, int]:
        """(device, host) bytes alive now."""
        self._scan()
        return self._device_now, self._host_now

    # -- the dispatch hook ----------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func is _DEVICE:  # a metadata query (autograd asks it of every gradient)
            t = args[0]
            if isinstance(t, FakeTensor) and not t.fake_mode.in_kernel_invocation:
                return t.fake_device  # FakeTensor's own answer, without the round trip
            return func(*args)
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 0
        if func in _COPIES:
            self._count_copy(func, args, kwargs)
        held = self._hold_scratch(func, args)  # noqa: F841 - alive until the peak is read
        out = func(*args, **kwargs)
        for t in _fakes((out, args, tuple(kwargs.values()))):
            self._register(t)
        if (
            self._device_bound <= self._current.device_peak
            and self._host_bound <= self._current.host_peak
        ):
            return out  # nothing can have passed a peak
        self._scan()
        grew_device = self._device_now > self._current.device_peak
        grew_host = self._host_now > self._current.host_peak
        if grew_device:
            self._current.device_peak = self._device_now
        if grew_host:
            self._current.host_peak = self._host_now
        if grew_device or grew_host:
            self._snapshot(
                grew_device and self._device_now > self._snap_device * (1 + _SNAPSHOT_STEP),
                grew_host and self._host_now > self._snap_host * (1 + _SNAPSHOT_STEP),
            )
        return out

    def _hold_scratch(self, func: Any, args: tuple) -> torch.Tensor | None:
        nbytes = self.scratch(func, args) if self.scratch is not None else 0
        if not nbytes:
            return None
        held = torch.empty(nbytes, dtype=torch.uint8, device=self.device_type)
        self._register(held)
        self.tag(held, ACTIVATIONS)
        return held

    def _count_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0].device.type, args[1].device.type
            nbytes = args[1].numel() * args[1].element_size()
        else:
            src = args[0].device.type
            dst = torch.device(kwargs.get("device") or args[0].device).type
            nbytes = args[0].numel() * args[0].element_size()
        if src == "cpu" and dst == self.device_type:
            self._current.h2d_bytes += nbytes
        elif src == self.device_type and dst == "cpu":
            self._current.d2h_bytes += nbytes

    def _register(self, t: torch.Tensor) -> None:
        device = t.device.type
        if device not in (self.device_type, "cpu"):
            return
        st = t.untyped_storage()
        key = st._cdata
        known = self._live.get(key)
        if known is not None and known[0]() is not None:
            grown = st.nbytes() - known[3]  # a storage resized in place (stage 3's units)
            if grown > 0:
                known[3] += grown
                self._grow(known[1], grown)
            return
        nbytes = st.nbytes()
        on_device = device == self.device_type
        self._live[key] = [weakref.ref(st), on_device, self._guess_kind(), nbytes]
        self._grow(on_device, nbytes)

    def _grow(self, on_device: bool, nbytes: int) -> None:
        if on_device:
            self._device_bound += nbytes
        else:
            self._host_bound += nbytes

    def _guess_kind(self) -> str | None:
        frame: FrameType | None = sys._getframe(3)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name in _MODULE_KINDS and frame.f_code.co_name != "__torch_function__":
                return _FUNCTION_KINDS.get((name, frame.f_code.co_name), _MODULE_KINDS[name])
            frame = frame.f_back
        return None

    def _scan(self) -> None:
        device = host = 0
        dead = []
        for key, entry in self._live.items():
            st = entry[0]()
            if st is None:
                dead.append(key)
                continue
            entry[3] = nbytes = st.nbytes()
            if entry[1]:
                device += nbytes
            else:
                host += nbytes
        for key in dead:
            del self._live[key]
        self._device_now = self._device_bound = device
        self._host_now = self._host_bound = host

    def _snapshot(self, device: bool, host: bool) -> None:
        if not (device or host):
            return
        known = self.identify()
        default = ACTIVATIONS if self.phase in _RUNNING else OTHER
        kinds: tuple[dict[str, int], dict[str, int]] = ({}, {})
        for key, (ref, on_device, tag, _) in self._live.items():
            st = ref()
            if st is None or not st.nbytes():
                continue
            kind = known.get(key) or tag or default
            side = kinds[0] if on_device else kinds[1]
            side[kind] = side.get(kind, 0) + st.nbytes()
        if device:
            self._current.device_kinds = kinds[0]
            acts = kinds[0].get(ACTIVATIONS, 0)
            self._current.activations_peak = max(self._current.activations_peak, acts)
            self._snap_device = self._device_now
        if host:
            self._current.host_kinds = kinds[1]
            self._snap_host = self._host_now
