"""The forward window: what every forward of the engine's model runs in, however it is called.

``engine(x)`` and ``model(x)`` are the same call (as with FSDP2's root module): the root
module's pre-forward hook opens the window — the engine's checks, rank 0's buffers taken
while training, stage 3's gathers and the activation offload's hooks around the forward, the
clock's forward phase — and moves the inputs to the device; its post-forward hook closes it,
on an exception too. A trainer whose step function calls submodules (Lightning's
``training_step`` calling ``self.net(x)``) opens one window around the whole step function
instead (``engine.forward_window()``), and the forwards inside it only move their inputs.

An interrupt (``KeyboardInterrupt``, a signal handler's exception) skips post-forward hooks
and would leave the window open: the next forward or engine call closes it first, as a
forward that failed.

Each forward's inputs move to the compute device keeping their containers' types
(:func:`move_inputs`), and module buffers (BatchNorm running statistics and the like) follow
rank 0 as with ``DistributedDataParallel``: copied to every rank at ``initialize`` and before
each training forward (``broadcast_buffers=True``), one collective per dtype
(:func:`broadcast_buffers`); exports read rank 0's values (:func:`rank0_values`).

:class:`EngineForward` is the part of :class:`zero_offload.Engine` that the model's calls go
through; the engine builds the attributes declared there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import sys
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

from ..activations.wiring import forward_context
from ..comm import Comm
from ..update.window import Phase
from ..weak import weak_hook

if TYPE_CHECKING:
    from ..activations.offload import ActivationOffload
    from ..config import ZeroConfig
    from ..params.gather import ParamGatherer
    from ..update.window import WindowCoordinator
    from .step_stats import StepRecord

__all__ = [
    "EngineForward",
    "ForwardWindow",
    "Opener",
    "broadcast_buffers",
    "move_inputs",
    "rank0_values",
]

ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


class Opener(enum.Enum):
    """Who opened the window, and so who closes it."""

    HOOK = "the root module's pre-forward hook"
    EXPLICIT = "engine.forward_window()"


class ForwardWindow:
    """One open forward context at a time; ``enter`` builds the engine's context for it."""

    def __init__(self, enter: Callable[[], ContextManager[None]]) -> None:
        self._enter = enter
        self._stack: contextlib.ExitStack | None = None
        self.opener: Opener | None = None

    @property
    def is_open(self) -> bool:
        return self._stack is not None

    def open(self, opener: Opener) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self._enter())  # raises before anything is held
        self._stack, self.opener = stack, opener

    def close(self, exc: ExcInfo = (None, None, None)) -> None:
        """Close the window; ``exc``: the exception ending the forward, if one does."""
        stack, self._stack, self.opener = self._stack, None, None
        if stack is not None:
            stack.__exit__(*exc)

    def end_interrupted(self) -> None:
        """Close a window its root forward left open (an interrupt skipped the post-forward
        hook): its parts see a forward that raised."""
        if self.opener is Opener.HOOK:
            interrupted = KeyboardInterrupt("the forward was interrupted")
            self.close((KeyboardInterrupt, interrupted, None))

    @contextlib.contextmanager
    def explicit(self) -> Iterator[None]:
        """A window around a trainer's step function (nested ones join the open one)."""
        self.end_interrupted()
        if self.is_open:
            yield
            return
        self.open(Opener.EXPLICIT)
        try:
            yield
        except BaseException:
            self.close(sys.exc_info())
            raise
        self.close()

    # -- the root module's hooks -----------------------------------------------------------
    def hook_root(
        self, model: nn.Module, pre_forward: Callable[..., tuple[tuple, dict] | None]
    ) -> list[Callable[[], None]]:
        """Hook ``model``, the root: ``pre_forward(module, args, kwargs)`` (which opens the
        window) before its other pre-forward hooks, the window closed after its other
        post-forward hooks (stage 3's release); returns what removes the hooks."""
        handles = [
            model.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True),
            model.register_forward_hook(weak_hook(self.after_root)),
            model.register_forward_hook(weak_hook(self.after_root_raised), always_call=True),
        ]
        return [h.remove for h in handles]

    def before_root(self) -> None:
        """The root module's forward begins: open the window unless one is open already."""
        self.end_interrupted()
        if not self.is_open:
            self.open(Opener.HOOK)

    def after_root(self, *_: Any) -> None:
        """The root module's forward returned: close the window it opened."""
        if self.opener is Opener.HOOK:
            self.close()

    def after_root_raised(self, *_: Any) -> None:
        """Called after every root forward (``always_call``); torch calls it from inside its
        ``except`` when the forward raised, and then :meth:`after_root` has not run."""
        if self.opener is Opener.HOOK:
            self.close(sys.exc_info())


class EngineForward:
    """The model's calls through an engine: the forward window each one runs in, the inputs
    moved to the device, and forwards that are not the model's own call."""

    config: ZeroConfig
    comm: Comm
    device: torch.device
    dtype: torch.dtype
    gatherer: ParamGatherer | None
    activations: ActivationOffload | None
    coordinator: WindowCoordinator
    record: StepRecord
    _module: nn.Module
    _closed: bool
    _window: ForwardWindow

    if TYPE_CHECKING:  # provided by the engine

        def _check_open(self, settle: bool = True) -> None: ...

    def _root_pre_forward(
        self, _module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        if self._closed or self.coordinator.lending:  # forwards read the lent values: no window
            return None
        self._window.before_root()
        return move_inputs(args, self.device, self.dtype), move_inputs(
            kwargs, self.device, self.dtype
        )

    @contextlib.contextmanager
    def _forward_context(self) -> Iterator[None]:
        """What one forward window holds: the engine's checks, rank 0's buffers taken while
        training, stage 3's gathers and the activations' hooks, the clock's forward phase."""
        self._check_open(settle=False)  # an update left running goes on unit by unit
        if self.config.broadcast_buffers and self._module.training:
            broadcast_buffers(self._module, self.comm)
        with (
            self.coordinator.during(Phase.FORWARD),
            forward_context(self.gatherer, self.activations),
            self.record.clock.phase("forward"),
        ):
            yield

    def forward_window(self) -> ContextManager[None]:
        """One forward window around a trainer's step function, for step functions that call
        submodules rather than the model (forwards inside it join it). ``engine(x)`` and
        ``model(x)`` open their own window and need none."""
        self._check_open(settle=False)
        return self._window.explicit()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward on this rank's micro-batch (tensors inside any containers
        go to the device, floating ones in the compute dtype). While training, every rank
        first takes rank 0's buffers (``broadcast_buffers``). The same call as
        ``model(*args, **kwargs)``: the root module's hooks do this (``engine/forward.py``)."""
        self._check_open(settle=False)
        return self._module(*args, **kwargs)

    forward = __call__

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as a forward of the engine, for a forward that is not the
        model's own call (e.g. ``activations.tiled_causal_lm_loss(engine.module, ...)``)."""
        args = move_inputs(args, self.device, self.dtype)
        kwargs = move_inputs(kwargs, self.device, self.dtype)
        with self.forward_window():
            return fn(*args, **kwargs)

    def gathered(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Inside :meth:`run`: ``module``'s parameters gathered for the block (stage 3; a
        no-op otherwise), for code that reads them without calling the module."""
        return self.gatherer.hold(module) if self.gatherer else contextlib.nullcontext()


def move_inputs(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``value`` with every tensor inside it on ``device`` (floating ones in ``dtype``)."""
    if isinstance(value, torch.Tensor):
        target = dtype if value.is_floating_point() else value.dtype
        return value.to(device=device, dtype=target)
    if isinstance(value, PackedSequence):  # batch_sizes stays on the host, as torch wants
        target = dtype if value.data.is_floating_point() else value.data.dtype
        # torch types PackedSequence.to as Tensor.to's first overload only (dtype, no device)
        return value.to(device=device, dtype=target)  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)):
        items = [move_inputs(v, device, dtype) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, tuple):
            if hasattr(value, "_fields"):  # a namedtuple
                return type(value)(*items)
            return tuple(items) if type(value) is tuple else type(value)(items)
        out = copy.copy(value)  # a list (subclass): same type, attributes kept
        out[:] = items
        return out
    if isinstance(value, Mapping):
        moved = {k: move_inputs(v, device, dtype) for k, v in value.items()}
        if all(moved[k] is v for k, v in value.items()):
            return value
        if isinstance(value, MutableMapping):  # dict, defaultdict, OrderedDict, UserDict…
            mutable = copy.copy(value)
            for k, v in moved.items():
                mutable[k] = v
            return mutable
        return moved  # a read-only mapping: a plain dict with the same items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: move_inputs(getattr(value, f.name), device, dtype)
            for f in dataclasses.fields(value)
            if f.init and hasattr(value, f.name)
        }
        if all(changes[k] is getattr(value, k) for k in changes):
            return value
        return dataclasses.replace(value, **changes)
    return value


def _by_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def rank0_values(tensors: list[torch.Tensor], comm: Comm) -> list[torch.Tensor]:
    """Rank 0's values of ``tensors`` (the same list on every rank), as new tensors."""
    if comm.world_size == 1:
        return [t.detach().clone() for t in tensors]
    out: dict[int, torch.Tensor] = {}
    for group in _by_dtype(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src=0)
        offset = 0
        for t in group:
            out[id(t)] = flat[offset : offset + t.numel()].view(t.shape).clone()
            offset += t.numel()
    return [out[id(t)] for t in tensors]


def broadcast_buffers(model: nn.Module, comm: Comm) -> None:
    """Every buffer of ``model`` takes rank 0's value, in place. Collective."""
    if comm.world_size == 1:
        return
    buffers = [b for b in model.buffers() if b.numel()]
    with torch.no_grad():
        for b, value in zip(buffers, rank0_values(buffers, comm)):
            b.copy_(value)
