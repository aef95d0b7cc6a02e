"""Which saved tensors activation offload takes.

With activation checkpointing, what a forward keeps on the device for backward is, above all,
the input of each checkpointed region (a transformer layer's hidden states): everything saved
inside a region is recomputed. ``torch.utils.checkpoint`` saves those inputs through the
saved-tensor hooks around it, from one of two places: the non-reentrant variant's
``_CheckpointFrame.save_inputs`` (its own hooks are pushed only after it), the reentrant one's
``CheckpointFunction`` (``ctx.save_for_backward`` packs as its ``apply`` returns). A pack hook
tells them from any other saved tensor by the code object of the frame that asked. Up to torch
2.13 ``Function.apply`` is Python, and its frame names the class; from 2.14 it is C, leaving no
frame, and the hook's caller is the checkpoint function that called ``CheckpointFunction.apply``.
These are identified once, at import, and a torch that renamed them fails
``test_activation_offload`` rather than offloading nothing in silence (the offload also warns
when a forward with checkpointing on found no input to take).
"""

from __future__ import annotations

import inspect
import sys
from types import CodeType, FrameType, FunctionType

import torch
import torch.utils.checkpoint as _checkpoint
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["saved_by_checkpoint", "storage_layout"]

_SAVE_INPUTS: CodeType | None = getattr(
    getattr(getattr(_checkpoint, "_CheckpointFrame", None), "save_inputs", None), "__code__", None
)
_REENTRANT = _checkpoint.CheckpointFunction
# torch <= 2.13: the Python classmethod Function.apply, whose frame holds ``cls``.
_APPLY: CodeType | None = getattr(
    getattr(torch.autograd.Function.apply, "__func__", None), "__code__", None
)
# torch >= 2.14 (a C apply): the functions of torch.utils.checkpoint that call
# CheckpointFunction.apply, seen as the pack hook's own caller.
_CALLS_REENTRANT: frozenset[CodeType] = frozenset(
    inspect.unwrap(f).__code__
    for f in vars(_checkpoint).values()
    if isinstance(f, FunctionType) and "CheckpointFunction" in inspect.unwrap(f).__code__.co_names
)
_FRAMES = 4  # the pack hook, then (a comprehension, on Python < 3.12) the saver


def saved_by_checkpoint() -> bool:
    """Whether the tensor a pack hook (the caller's caller) is given is the input of a
    checkpointed region that ``torch.utils.checkpoint`` keeps for its recomputation."""
    frame: FrameType | None = sys._getframe(2)
    caller = frame.f_back if frame is not None else None
    if _APPLY is None and caller is not None and caller.f_code in _CALLS_REENTRANT:
        return True
    for _ in range(_FRAMES):
        if frame is None:
            return False
        code = frame.f_code
        if code is _SAVE_INPUTS:
            return True
        if code is _APPLY:
            cls = frame.f_locals.get("cls")
            return isinstance(cls, type) and issubclass(cls, _REENTRANT)
        frame = frame.f_back
    return False


def storage_layout(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s storage when offload can move it (a plain strided tensor, or a
    rehearsal's fake one, whose storage holds whole elements), else 0. The whole storage
    moves, so every view of it saved comes back as it was: same strides, same offset."""
    if tensor.layout is not torch.strided:
        return 0
    if type(tensor) is not torch.Tensor and not isinstance(tensor, FakeTensor):
        return 0  # a subclass (DTensor, quantized weights, ...) knows its own layout
    nbytes = tensor.untyped_storage().nbytes()
    return nbytes if nbytes % tensor.element_size() == 0 else 0
