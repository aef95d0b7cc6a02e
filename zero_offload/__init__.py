"""zero_offload: ZeRO stages 0-3 with CPU/NVMe offload on torch.distributed.

    import zero_offload as zo
    engine = zo.initialize(model, stage=3, lr=1e-4, dtype=torch.bfloat16)
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()
"""
from .config import ConfigError, ZeroConfig, build_config, config_keys
from .engine import Engine, initialize
from .ledger import MemoryReport
from .planner import estimate_memory, plan

__all__ = ["ConfigError", "ZeroConfig", "build_config", "config_keys", "Engine", "initialize",
           "MemoryReport", "estimate_memory", "plan"]
__version__ = "0.1.0"
