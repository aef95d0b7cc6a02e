"""Checks every config section shares: a bad value named with what is allowed, numbers in
their range, whole numbers from JSON floats, the compute dtype by name."""

from __future__ import annotations

import math
import numbers
import typing
from dataclasses import fields
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["DTYPES", "RENAMES", "bad", "compute_dtype", "number", "whole_numbers"]

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Flat user-facing keys named otherwise than their field: key -> (section attribute, field name).
RENAMES = {
    "offload_optimizer": ("offload", "optimizer"),
    "offload_param": ("offload", "param"),
    "offload_optimizer_fraction": ("offload", "optimizer_fraction"),
    "offload_param_fraction": ("offload", "param_fraction"),
    "offload_activations": ("activations", "mode"),
    "offload_activations_min_bytes": ("activations", "min_bytes"),
    "offload_activations_prefetch": ("activations", "prefetch"),
}


def bad(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is not valid: {allowed}")


def number(
    key: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    integer: bool = False,
    inf_ok: bool = False,
) -> float | int:
    """``value`` as a float (an int with ``integer``) in [lo, hi] (lo excluded with
    ``lo_open``), else a :class:`ConfigError` naming ``key``. nan is always refused (it
    passes every comparison), +-inf too unless ``inf_ok`` (where inf means "unbounded")."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, value, f"expected {kind}")
    if integer and not float(value).is_integer():
        raise bad(key, value, f"expected {kind}")
    if math.isnan(value) or (math.isinf(value) and not inf_ok):
        bounds = [f"{'>' if lo_open else '>='} {lo:g}"] if lo is not None else []
        bounds += [f"<= {hi:g}"] if hi is not None else []
        want = " ".join(["number" if inf_ok else "finite number", " and ".join(bounds)])
        raise bad(key, value, f"expected a {want.strip()}" + (" or inf" if inf_ok else ""))
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise bad(key, value, f"expected {kind} {'>' if lo_open else '>='} {lo:g}")
    if hi is not None and value > hi:
        raise bad(key, value, f"expected {kind} <= {hi:g}")
    return int(value) if integer else float(value)


def compute_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The ``dtype`` key's value (a torch dtype or its name) as a torch dtype."""
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPES:
            raise bad("dtype", dtype, "expected float32, bfloat16 or float16")
        dtype = DTYPES[dtype.removeprefix("torch.")]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise bad("dtype", dtype, "expected torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def whole_numbers(section: Any) -> None:
    """Store every ``int``-typed field of a config dataclass as a real int.

    Why: JSON and YAML configs routinely carry ``8e9`` or ``2.0``; a float that reaches a slice
    or a buffer count fails far from the config, so an integral float becomes its int here
    and a fractional one (or nan/inf) is refused naming the key. Reads the type hints, so a
    new whole-number field is covered without being listed.
    """
    hints = typing.get_type_hints(type(section))
    renamed = {name: key for key, (_, name) in RENAMES.items()}
    for f in fields(section):
        if hints[f.name] not in (int, int | None):
            continue
        value = getattr(section, f.name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue  # None, or a wrong type the field's own check names
        if isinstance(value, numbers.Integral):
            whole = int(value)
        elif float(value).is_integer():
            whole = int(float(value))
        else:
            key = renamed.get(f.name, f.name)
            raise bad(key, value, "expected an integer (a float must be whole, e.g. 8e9)")
        object.__setattr__(section, f.name, whole)
