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
each training forward (``broadcast_buffers=True``, ``engine.weights.broadcast_buffers``).

:class:`ForwardDriver` is the engine's object the model's calls go through: the root module's
pre-forward hook, the context each window holds, and forwards that are not the model's own.
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
from ..config import ZeroConfig
from ..update.window import Phase
from ..weak import weak_hook
from .weights import broadcast_buffers

if TYPE_CHECKING:
    from .build import Parts
    from .lifecycle import Lifecycle
    from .steps import StepRecord

__all__ = [
    "ForwardDriver",
    "ForwardWindow",
    "Opener",
    "move_inputs",
]

ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


class Opener(enum.Enum):
    """Who opened the window, and so who closes it."""

    HOOK = "the root module's pre-forward hook"
    EXPLICIT = "engine.forward_window()"


class ForwardWindow:
    """One open forward context at a time; whoever opens it passes the context it holds."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self.opener: Opener | None = None

    @property
    def is_open(self) -> bool:
        return self._stack is not None

    def open(self, opener: Opener, enter: Callable[[], ContextManager[None]]) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(enter())  # raises before anything is held
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
    def explicit(self, enter: Callable[[], ContextManager[None]]) -> Iterator[None]:
        """A window around a trainer's step function (nested ones join the open one)."""
        self.end_interrupted()
        if self.is_open:
            yield
            return
        self.open(Opener.EXPLICIT, enter)
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

    def before_root(self, enter: Callable[[], ContextManager[None]]) -> None:
        """The root module's forward begins: open the window unless one is open already."""
        self.end_interrupted()
        if not self.is_open:
            self.open(Opener.HOOK, enter)

    def after_root(self, *_: Any) -> None:
        """The root module's forward returned: close the window it opened."""
        if self.opener is Opener.HOOK:
            self.close()

    def after_root_raised(self, *_: Any) -> None:
        """Called after every root forward (``always_call``); torch calls it from inside its
        ``except`` when the forward raised, and then :meth:`after_root` has not run."""
        if self.opener is Opener.HOOK:
            self.close(sys.exc_info())


class ForwardDriver:
    """The model's calls through an engine: the forward window each one runs in, the inputs
    moved to the device, and forwards that are not the model's own call. It reads the
    gatherer and the activation offload from the engine's shared ``parts``."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        comm: Comm,
        device: torch.device,
        parts: Parts,
        lifecycle: Lifecycle,
        window: ForwardWindow,
        record: StepRecord,
    ) -> None:
        self._module = module
        self._config = config
        self._comm = comm
        self._device = device
        self._dtype = config.precision.dtype
        self._parts = parts
        self._lifecycle = lifecycle
        self._window = window
        self._record = record

    def root_pre_forward(
        self, _module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        """The root module's pre-forward hook: open the window, move the inputs."""
        if self._lifecycle.closed or self._parts.coordinator.lending:
            return None  # forwards read the lent values: no window
        self._window.before_root(self._context)
        return self.moved(args), self.moved(kwargs)

    def moved(self, value: Any) -> Any:
        """``value`` with its tensors on the device (floating ones in the compute dtype)."""
        return move_inputs(value, self._device, self._dtype)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """What one forward window holds: the engine's checks, rank 0's buffers taken while
        training, stage 3's gathers and the activations' hooks, the clock's forward phase."""
        self._lifecycle.check_open(settle=False)  # an update left running goes on unit by unit
        if self._config.broadcast_buffers and self._module.training:
            broadcast_buffers(self._module, self._comm)
        with (
            self._parts.coordinator.during(Phase.FORWARD),
            forward_context(self._parts.gatherer, self._parts.activations),
            self._record.clock.phase("forward"),
        ):
            yield

    def window(self) -> ContextManager[None]:
        """See :meth:`zero_offload.Engine.forward_window`."""
        self._lifecycle.check_open(settle=False)
        return self._window.explicit(self._context)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own call (its root hooks open the window)."""
        self._lifecycle.check_open(settle=False)
        return self._module(*args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """See :meth:`zero_offload.Engine.run`."""
        args, kwargs = self.moved(args), self.moved(kwargs)
        with self.window():
            return fn(*args, **kwargs)

    def gathered(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """See :meth:`zero_offload.Engine.gathered`."""
        gatherer = self._parts.gatherer
        return gatherer.hold(module) if gatherer else contextlib.nullcontext()


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
