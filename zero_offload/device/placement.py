"""The compute device a rank uses (and whether its dtype runs well there), and the one
function that copies model values onto it while the engine builds its units or exports them.

Stage 3 exists for models that do not fit on one device, so ``initialize`` and
``full_state_dict`` must never hold more than one unit there at a time. Every such copy goes
through :func:`to_device`, which makes that bound checkable (and countable in tests) on any
machine, the CPU included, where a "move" costs nothing and hides the difference.
"""

from __future__ import annotations

import functools
import logging
import os
import platform

import torch
import torch.nn as nn

from ..policies import Stage

__all__ = [
    "move_model",
    "native_cpu_matmul",
    "select_device",
    "to_device",
    "warn_if_slow_on_cpu",
]

log = logging.getLogger(__name__)


def to_device(
    tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``tensor`` on ``device`` (in ``dtype``); the input itself when it is already there."""
    return tensor.to(device=device, dtype=dtype or tensor.dtype)


def select_device(requested: torch.device | None) -> torch.device:
    """The compute device: ``requested``, else ``cuda:(LOCAL_RANK mod visible GPUs)`` when
    CUDA is there (a launcher may show each process all GPUs or only its own), else the CPU.
    A CUDA device is made current, so that what torch puts on "the" GPU — the tensors of
    ``all_gather_object``, contexts made by other threads — lands on this rank's GPU."""
    if requested is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        local = int(os.environ.get("LOCAL_RANK", 0))
        requested = torch.device("cuda", local % torch.cuda.device_count())
    if requested.type == "cuda" and requested.index is not None:
        torch.cuda.set_device(requested)
    return requested


def native_cpu_matmul(dtype: torch.dtype) -> bool:
    """Whether this x86 CPU multiplies ``dtype`` matrices in hardware (oneDNN's bf16 needs
    AVX512-BF16 or AMX, its fp16 AVX512-FP16 or AMX-FP16). Without it torch falls back to a
    reference kernel: a bf16 GEMM at 0.3-1 GFLOP/s on a 2-vCPU AVX2 host (AMD EPYC) where
    fp32 made 80. True where it cannot tell (another architecture, an older torch)."""
    if dtype not in (torch.bfloat16, torch.float16) or platform.machine().lower() not in (
        "x86_64",
        "amd64",
    ):
        return True
    check = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return True


@functools.lru_cache(maxsize=None)
def warn_if_slow_on_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    """Log once per process when a CPU device computes in a dtype this CPU has no matrix
    instructions for (a step would take tens of times longer than in fp32); returns
    whether it warned."""
    if device.type != "cpu" or native_cpu_matmul(dtype):
        return False
    name = str(dtype).removeprefix("torch.")
    needs = "AVX512-BF16 or AMX" if dtype == torch.bfloat16 else "AVX512-FP16 or AMX-FP16"
    log.warning(
        "zero_offload: this CPU has no %s matrix instructions (%s): torch multiplies %s "
        "matrices in a reference kernel, tens of times slower than float32. On a CPU "
        "device use dtype=torch.float32, or train on a GPU",
        name,
        needs,
        name,
    )
    return True


def move_model(model: nn.Module, device: torch.device, stage: Stage) -> None:
    """Put the model's buffers, and (stages 0–2) its parameters, on the device. Stage 3
    leaves parameters where they are: each unit goes to the device when it is built. So do
    parameters on the meta device, which their unit materializes."""
    for module in model.modules():
        if not stage.shards_params:
            for p in module._parameters.values():
                if p is not None and not p.is_meta and p.device != device:
                    p.data = to_device(p.data, device)
        for name, b in module._buffers.items():
            if b is not None:
                if b.is_meta:
                    raise ValueError(
                        f"buffer {name!r} of {type(module).__name__} is on the meta device; "
                        "zero_offload materializes meta parameters (through "
                        "reset_parameters() or init_weights) but cannot know a buffer's "
                        "values: build the model with only its parameters on the meta device "
                        "(accelerate.init_empty_weights() does so by default), or create its "
                        "buffers on a real device"
                    )
                module._buffers[name] = to_device(b, device)
