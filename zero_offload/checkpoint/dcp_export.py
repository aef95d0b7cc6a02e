"""Export: any checkpoint (this library's, DeepSpeed's) as a ``torch.distributed.checkpoint``
folder laid out as FSDP2's ``get_state_dict`` (see ``dcp``), written one tensor at a time.

DCP's writer asks its planner for each tensor only as it writes it (``resolve_data``): the
state dict handed to ``dcp.save`` holds meta tensors, and the planner reads each one's values
from the checkpoint then, so memory is one tensor whatever the model's size.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..progress import Progress
from .dcp import SECTION, torch_group
from .load import open_source

__all__ = ["export_dcp"]

log = logging.getLogger(__name__)


def _lazy_planner(fill: Any) -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        """Tensors given as meta tensors are read from ``fill`` only when written."""

        def resolve_data(self, write_item: Any) -> Any:
            obj = self.lookup_object(write_item.index)
            if isinstance(obj, torch.Tensor) and obj.is_meta:
                return fill(write_item.index.fqn, obj)
            return super().resolve_data(write_item)

    return LazySavePlanner()


def export_dcp(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    tag: str | None = None,
    model_key: str = "model",
    optim_key: str = "optim",
) -> Path:
    """Write the checkpoint in ``directory`` (this library's, or DeepSpeed's) to the DCP folder
    ``out`` as FSDP2's ``get_state_dict`` lays it out: ``{model_key: {name: fp32},
    optim_key: {"state": {name: {step, exp_avg, exp_avg_sq}}, "param_groups": [...]}}``, tied
    names under each of their names, persistent buffers beside the parameters, plus the
    counters and lr scheduler state (``model_key=""``: the parameters at the top level, as
    torchtitan keeps them). Moments are fp32 whatever precision kept them, named as the
    matching torch optimizer names them (Adagrad: ``sum``; Lion: ``exp_avg``), and the
    optimizer kind is recorded. Streams one tensor at a time; needs no process group."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    source = open_source(directory, tag)
    try:
        extra, _ = source.extra(0)
        names = list(source.shapes)
        steps = extra["optimizer_steps"]
        missed = extra.get("missed_updates") or {}
        kind = source.policy.kind
        model: dict[str, Any] = {n: torch.empty(source.shapes[n], device="meta") for n in names}
        model.update({a: model[n] for a, n in source.aliases.items()})
        buffers = extra.get("buffers") or {}
        model.update({n: buffers[n] for n in buffers})  # persistent buffers, as msd has them
        state = {
            n: {
                "step": torch.tensor(float(steps - missed.get(n, 0))),
                **{m: torch.empty(source.shapes[n], device="meta") for m in kind.moment_names},
            }
            for n in names
        }
        group = {**torch_group(kind), **(extra["param_groups"] or [{}])[0], "params": names}
        sd: dict[str, Any] = {model_key: model} if model_key else dict(model)
        sd[optim_key] = {"state": state, "param_groups": [group]}
        sd["zero_offload"] = {k: extra[k] for k in ("micro_steps", "global_steps")}
        sd["zero_offload"]["optimizer_type"] = kind.value
        if extra.get("lr_scheduler") is not None:
            sd["lr_scheduler"] = extra["lr_scheduler"]
        prefix = f"{model_key}." if model_key else ""  # "": at the top level, as torchtitan
        section_of = {prefix + n: (n, 0) for n in names}
        section_of.update({prefix + a: (n, 0) for a, n in source.aliases.items()})
        for n in names:
            for m in kind.moment_names:
                section_of[f"{optim_key}.state.{n}.{m}"] = (n, SECTION[m])

        total = sum(math.prod(source.shapes[n]) for n in names) * (1 + len(kind.moment_names))
        progress = Progress(f"exporting {source.where} to {out}", total, "values", logger=log)

        def fill(fqn: str, meta: torch.Tensor) -> torch.Tensor:
            name, section = section_of[fqn]
            values = torch.zeros(meta.shape, dtype=torch.float32)
            wanted: list[torch.Tensor | None] = [None, None, None]
            wanted[section] = values.view(-1)
            source.read(name, 0, values.numel(), wanted)
            progress.update(values.numel())
            return values

        Path(out).mkdir(parents=True, exist_ok=True)
        try:
            save(
                sd,
                storage_writer=FileSystemWriter(str(out)),
                planner=_lazy_planner(fill),
                no_dist=True,
            )
        finally:
            progress.close()
    finally:
        source.close()
    return Path(out)
