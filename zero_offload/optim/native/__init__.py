"""The C kernels: compiled on first use for this CPU and loaded with ctypes (:mod:`.build`),
the Adam update (:mod:`.adam_kernel`) and the step of every other kind and state precision
(:mod:`.optim_kernel`)."""

from .adam_kernel import adam_update, default_num_threads, get_kernel, kernel_status
from .build import KernelBuildError, cache_dir, compiler, kernels_dir, load_library
from .optim_kernel import get_optim_kernel

__all__ = [
    "KernelBuildError",
    "adam_update",
    "cache_dir",
    "compiler",
    "default_num_threads",
    "get_kernel",
    "get_optim_kernel",
    "kernel_status",
    "kernels_dir",
    "load_library",
]
