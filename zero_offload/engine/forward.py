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
"""

from __future__ import annotations

import contextlib
import enum
import sys
from types import TracebackType
from typing import Any, Callable, ContextManager, Iterator

import torch.nn as nn

from ..weak import weak_hook

__all__ = ["ForwardWindow", "Opener"]

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
