"""The swap tiers: async direct file I/O, aligned host buffers, and the swapper."""

from ..errors import BufferBudgetError, SwapIOError, SwapSpaceError
from .buffers import ALIGNMENT, BufferPool, HostBuffer, round_up
from .io import FileIOEngine, IOBackend, OsBackend
from .swapper import Swapper, Tier

__all__ = [
    "FileIOEngine",
    "IOBackend",
    "OsBackend",
    "HostBuffer",
    "BufferPool",
    "Swapper",
    "Tier",
    "SwapIOError",
    "SwapSpaceError",
    "BufferBudgetError",
    "round_up",
    "ALIGNMENT",
]
