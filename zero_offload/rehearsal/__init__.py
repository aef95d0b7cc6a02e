"""Rehearse a run's GPU memory on a machine without one: the engine's own code on a simulated
device, every allocation counted, beside the planner's estimate and the GPU size."""

from .report import Rehearsal
from .run import rehearse

__all__ = ["rehearse", "Rehearsal"]
