"""zero_offload: ZeRO stages 0-3 with CPU/NVMe offload on torch.distributed."""
