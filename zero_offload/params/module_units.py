"""Stage 3: which units each module gathers before it runs.

A module gathers the units of its own parameters and those of the parameters declared
external for it (``register_external_parameter``), its own first; units that keep their
parameters whole on every rank are never gathered.
"""

from __future__ import annotations

import torch.nn as nn

from .external import declared_external
from .units import FlatUnit

__all__ = ["ModuleUnits", "RunningModule", "gathered_units"]


def gathered_units(prefetch_depth: int) -> int:
    """Units gathered at once, at most, as modules run one after another: the running
    module's and ``prefetch_depth`` gathered ahead of it."""
    return prefetch_depth + 1


class ModuleUnits:
    """The units each module of ``model`` gathers: ``own`` (its parameters') and ``declared``
    (parameters declared external for it, less its own), each in first-use order; modules
    without any are absent."""

    def __init__(self, model: nn.Module, units: list[FlatUnit], names: dict[nn.Module, str]):
        by_param = {id(p): u for u in units for p in u.params}
        self.own: dict[nn.Module, list[FlatUnit]] = {}
        self.declared: dict[nn.Module, list[FlatUnit]] = {}
        for module in model.modules():
            for table, params in (
                (self.own, module.parameters(recurse=False)),
                (self.declared, declared_external(module)),
            ):
                found: list[FlatUnit] = []
                for p in params:
                    u = by_param.get(id(p))
                    if u is None:
                        raise ValueError(
                            f"a parameter declared external for "
                            f"{names.get(module, type(module).__name__)} is not "
                            "a parameter of the model"
                        )
                    if u.sharded_params and u not in found:
                        found.append(u)
                if found:
                    table[module] = found
        for module, found in self.declared.items():  # a module's own units come first
            self.declared[module] = [u for u in found if u not in self.own.get(module, [])]


class RunningModule:
    """A stage-3 module whose forward is running: the units gathered for it, those gathered
    on demand while it ran (released with it), and whether it turned the access check on."""

    __slots__ = ("module", "units", "borrowed", "entered")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.units: list[FlatUnit] = []
        self.borrowed: list[FlatUnit] = []
        self.entered = False
