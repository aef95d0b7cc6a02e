"""The optimizer on the host: state policies and layouts, the native kernels with a torch
fallback, and torch optimizer classes over them."""

from zero_offload.optim.cpu_adam import CPUAdam, CPUAdamW
from zero_offload.optim.cpu_optim import (
    CPUAdagrad,
    CPUAdamW8bit,
    CPULion,
    CPULion8bit,
    CPUOptimizer,
)
from zero_offload.optim.hyper import StepHyper
from zero_offload.optim.layout import Piece, Span, StateLayout
from zero_offload.optim.native import adam_update, default_num_threads, kernel_status
from zero_offload.optim.policy import MasterPrecision, MomentPrecision, OptimizerKind, StatePolicy
from zero_offload.optim.state import MomentState, ShardState, buffer_bytes
from zero_offload.optim.step import step

__all__ = [
    "CPUAdagrad",
    "CPUAdam",
    "CPUAdamW",
    "CPUAdamW8bit",
    "CPULion",
    "CPULion8bit",
    "CPUOptimizer",
    "MasterPrecision",
    "MomentPrecision",
    "MomentState",
    "OptimizerKind",
    "Piece",
    "ShardState",
    "Span",
    "StateLayout",
    "StatePolicy",
    "StepHyper",
    "adam_update",
    "buffer_bytes",
    "default_num_threads",
    "kernel_status",
    "step",
]
