"""zero_offload: ZeRO stages 0-3 with CPU/NVMe offload on torch.distributed.

import zero_offload as zo
engine = zo.initialize(model, stage=3, lr=1e-4, dtype=torch.bfloat16)
loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()
"""

from .checkpoint import consolidate_checkpoint
from .config import ZeroConfig, build_config, config_keys
from .engine.engine import Engine, initialize
from .errors import (
    BufferBudgetError,
    CheckpointError,
    ConfigError,
    DivergentForwardError,
    IncompleteStepError,
    IsaUnavailable,
    KernelBuildError,
    ParameterNotGatheredError,
    SwapIOError,
    SwapSpaceError,
    ZeroOffloadError,
)
from .memory.ledger import MemoryReport
from .optim import CPUAdam, CPUAdamW
from .params.external import register_external_parameter
from .planning.search.planner import estimate_memory, plan
from .rehearsal import Rehearsal, rehearse

__all__ = [
    "ConfigError",
    "ZeroConfig",
    "build_config",
    "config_keys",
    "Engine",
    "initialize",
    "MemoryReport",
    "estimate_memory",
    "plan",
    "rehearse",
    "Rehearsal",
    "consolidate_checkpoint",
    "CheckpointError",
    "CPUAdam",
    "CPUAdamW",
    "register_external_parameter",
    # every error a user can meet (zero_offload.errors)
    "ZeroOffloadError",
    "BufferBudgetError",
    "DivergentForwardError",
    "IncompleteStepError",
    "IsaUnavailable",
    "KernelBuildError",
    "ParameterNotGatheredError",
    "SwapIOError",
    "SwapSpaceError",
]
__version__ = "0.1.0"
