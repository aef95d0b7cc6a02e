"""Sizes and counts as people type them on a command line, read one way by every command.

Sizes: decimal units (KB, MB, GB, TB = 1e3 … 1e12 bytes), binary ones (KiB, MiB, GiB, TiB),
and the bare letters K, M, G, T, which are binary as in ``fio`` and ``dd`` (``--size 4G`` is
4 GiB); a plain number is bytes. Counts: K, M, B (or G), T suffixes or plain numbers such as
``13e9``. Rates: a size per second, with or without ``/s`` (``6GB/s``, ``6e9``).
"""

from __future__ import annotations

import argparse
import math
import re

__all__ = ["parse_count", "parse_rate", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(text: str, units: dict[str, int], what: str, example: str) -> int:
    m = _NUMBER.match(text)
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what} (e.g. {example})")
    value = float(m.group(1)) * units[m.group(2).lower()]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is too large a {what} (e.g. {example})")
    return int(value)


def parse_size(text: str) -> int:
    """'24GB' -> 24_000_000_000; '24GiB' and '24G' -> 25_769_803_776; '1024' -> 1024 bytes."""
    return _parse(text, _SIZE_UNITS, "size", "24GB, 24GiB, 512M")


def parse_count(text: str) -> int:
    """'13e9', '13B', '6.7b', '350M' -> a parameter count."""
    return _parse(text, _COUNT_UNITS, "count", "13e9, 13B")


def parse_rate(text: str) -> float:
    """'6GB/s', '3.5GiB/s', '6e9' -> bytes (or FLOPs) per second."""
    body = text.strip()
    return float(parse_size(body[:-2] if body.lower().endswith("/s") else body))
