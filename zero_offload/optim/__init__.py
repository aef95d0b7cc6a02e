"""CPU Adam/AdamW for offloaded shards: a native kernel with a torch fallback."""

from zero_offload.optim.cpu_adam import CPUAdam, CPUAdamW
from zero_offload.optim.kernel import adam_update, default_num_threads, kernel_status

__all__ = ["CPUAdam", "CPUAdamW", "adam_update", "default_num_threads", "kernel_status"]
