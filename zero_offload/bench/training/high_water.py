"""The process's peak resident memory over a stretch of code, from the kernel's high-water
mark (``VmHWM`` in ``/proc/self/status``), reset by writing 5 to ``/proc/self/clear_refs``.
Exact and free, where a sampling thread misses short peaks and takes a core's time; None off
Linux."""

from __future__ import annotations

__all__ = ["HighWater"]


class HighWater:
    """``reset()`` starts a stretch; ``peak()`` is the largest RSS in bytes since then."""

    def __init__(self) -> None:
        self.available = self._write_clear_refs() and self._read_hwm() is not None

    def reset(self) -> None:
        if self.available:
            self._write_clear_refs()

    def peak(self) -> int | None:
        return self._read_hwm() if self.available else None

    @staticmethod
    def _write_clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _read_hwm() -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None
