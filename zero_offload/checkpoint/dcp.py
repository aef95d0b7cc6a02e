"""``torch.distributed.checkpoint`` (DCP) folders in and out, laid out as FSDP2 saves them.

An FSDP2 / torchtitan run saves ``dcp.save({"model": msd, "optim": osd})`` with ``msd, osd =
get_state_dict(model, optimizer)``: parameters under ``<model prefix><name>`` and Adam's state
under ``<optim prefix>state.<name>.{exp_avg, exp_avg_sq, step}``, hyperparameters under
``<optim prefix>param_groups.<i>.<key>`` (torchtitan keeps the model's keys at the top level
and the optimizer under ``optimizer.``). :class:`DcpSource` finds the prefixes from the
metadata and reads one parameter at a time in fp32, resharded by DCP from however many ranks
saved it; :func:`export_dcp` writes any checkpoint (this library's, DeepSpeed's) in that
layout, one tensor in memory at a time, so ``dcp.load`` into an FSDP2 model's
``get_state_dict`` and ``set_state_dict`` continues the run. The export has one param group
(the engine's: one lr, betas, eps and weight decay), so the FSDP2 optimizer must have one too.

DCP keeps non-tensor values as pickles and its own planner unpickles them with
``weights_only=False``; here they are read with ``weights_only=True`` (plain data only).
"""

from __future__ import annotations

import io
import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .format import CheckpointError

__all__ = ["is_dcp", "DcpSource", "export_dcp"]

log = logging.getLogger(__name__)

_STATE = re.compile(r"(.*?)state\.(.+)\.exp_avg")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_ADAMW = dict(
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=None,
    decoupled_weight_decay=True,
)  # torch.optim.AdamW's other param-group keys, as get_state_dict saves them


def is_dcp(root: Path) -> bool:
    return (root / ".metadata").is_file()


def _planners() -> tuple[type, type]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class PlainLoadPlanner(DefaultLoadPlanner):
        """Non-tensor values read as plain data only (``weights_only=True``)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.state_dict[fqn] = torch.load(value, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - whatever weights_only refuses
                raise CheckpointError(
                    f"DCP value {fqn!r} is not plain data (loading it could run code from the "
                    f"file): {str(exc).strip().splitlines()[0]}"
                ) from exc

    class LazySavePlanner(DefaultSavePlanner):
        """Tensors given as meta tensors are read from ``fill`` only when written."""

        def __init__(self, fill: Any) -> None:
            super().__init__()
            self.fill = fill

        def resolve_data(self, write_item: Any) -> Any:
            obj = self.lookup_object(write_item.index)
            if isinstance(obj, torch.Tensor) and obj.is_meta:
                return self.fill(write_item.index.fqn, obj)
            return super().resolve_data(write_item)

    return PlainLoadPlanner, LazySavePlanner


class DcpSource:
    """A DCP folder as a :class:`~.source.Source`: one parameter's tensors in memory at a time."""

    def __init__(self, root: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.where, self.tag = root, root.name
        self._reader = FileSystemReader(str(root))
        meta = self._reader.read_metadata().state_dict_metadata
        self._meta = meta
        tensors = {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
        found = [(m.group(1), m.group(2)) for k in tensors if (m := _STATE.fullmatch(k))]
        self._opt = found[0][0] if found else None
        trained = [name for prefix, name in found if prefix == self._opt]
        if trained:
            first = trained[0]
            prefixes = [k[: -len(first)] for k in tensors if k.endswith(first) and k != first]
            prefixes += [""] if first in tensors else []
            model = next((p for p in prefixes if all(p + n in tensors for n in trained)), None)
        else:
            model = "model." if all(k.startswith("model.") for k in tensors) else ""
            log.warning("%s: no optimizer state; Adam starts from zero moments", root)
        if model is None:
            raise CheckpointError(f"{root}: optimizer state for {first!r} but no such parameter")
        self._model = model
        opt = self._opt or "\0"
        self.shapes = {
            k[len(model) :]: tuple(m.size)
            for k, m in tensors.items()
            if k.startswith(model) and not k.startswith(opt)
        }
        self.aliases: dict[str, str] = {}
        self.optional = set(self.shapes) - set(trained)  # frozen parameters or buffers
        self._trained = set(trained)
        self._cached: tuple[str, list[torch.Tensor | None]] | None = None

    def _load(self, keys: Sequence[str]) -> dict[str, Any]:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        load_planner, _ = _planners()
        state: dict[str, Any] = {}
        for k in keys:
            m = self._meta[k]
            state[k] = (
                torch.empty(tuple(m.size), dtype=m.properties.dtype)
                if isinstance(m, TensorStorageMetadata)
                else None
            )
        planner = load_planner(flatten_state_dict=False, flatten_sharded_tensors=False)
        load(state, storage_reader=self._reader, planner=planner, no_dist=True)
        return state

    def _nested(self, prefix: str) -> Any:
        """The values stored under ``prefix.`` rebuilt as the nested dicts and lists DCP
        flattened (``a.0.b`` -> ``{"a": [{"b": ...}]}``); None when there are none."""
        keys = [k for k in self._meta if k.startswith(prefix + ".")]
        if not keys:
            return None
        root: dict[str, Any] = {}
        for key, value in self._load(keys).items():
            *path, last = key[len(prefix) + 1 :].split(".")
            node = root
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        return _lists(root)

    def _tensors(self, name: str) -> list[torch.Tensor | None]:
        if self._cached is None or self._cached[0] != name:
            self._cached = None  # the previous parameter's memory first
            keys = [self._model + name]
            if name in self._trained:
                keys += [f"{self._opt}state.{name}.{m}" for m in _MOMENTS]
            got = self._load(keys)
            values = [got[k].reshape(-1).float() for k in keys]
            self._cached = (name, values + [None] * (3 - len(values)))
        return self._cached[1]

    def read(self, name: str, start: int, end: int, out: Sequence[torch.Tensor | None]) -> None:
        for array, values in zip(out, self._tensors(name)):
            if array is not None and values is not None:
                array.copy_(values[start:end])

    def extra(self, rank: int) -> tuple[dict[str, Any], bool]:
        opt = re.escape(self._opt or "\0")
        step, group = (
            re.compile(opt + r"state\.(.+)\.step"),
            re.compile(opt + r"param_groups\.(\d+)\.(\w+)"),
        )
        keys = [k for k in self._meta if step.fullmatch(k) or group.fullmatch(k)]
        got = self._load(keys)
        steps: dict[str, int] = {}
        groups: dict[int, dict[str, Any]] = {}
        for key, value in got.items():
            if m := step.fullmatch(key):
                steps[m.group(1)] = int(value)
            elif m := group.fullmatch(key):
                groups.setdefault(int(m.group(1)), {})[m.group(2)] = value
        adam = max(steps.values(), default=0)
        counters = self._nested("zero_offload") or {}
        return {
            "micro_steps": counters.get("micro_steps", adam),
            "global_steps": counters.get("global_steps", adam),
            "optimizer_steps": adam,
            "param_groups": _one_group([groups[i] for i in sorted(groups)], self.where),
            "loss_scaler": None,
            "missed_updates": {n: adam - k for n, k in steps.items() if k != adam},
            "lr_scheduler": self._nested("lr_scheduler"),
            "buffers": _LazyTensors(self, self.optional),
        }, False

    def close(self) -> None:
        self._cached = None


def _lists(node: Any) -> Any:
    """Dicts keyed 0..n-1 back into the lists they were."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node) and sorted(map(int, node)) == list(range(len(node))):
        return [node[str(i)] for i in range(len(node))]
    return node


class _LazyTensors(Mapping):
    """Buffers (or frozen parameters) by name, each read only when asked for."""

    def __init__(self, source: DcpSource, names: set[str]) -> None:
        self.source, self.names = source, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        key = self.source._model + name
        return self.source._load([key])[key]

    def __iter__(self) -> Any:
        return iter(sorted(self.names))

    def __len__(self) -> int:
        return len(self.names)


def _one_group(groups: list[dict[str, Any]], where: Path) -> list[dict[str, Any]]:
    """The engine's one param group from the saved ones (same lr, betas and eps in each)."""
    if not groups:
        return []
    out: dict[str, Any] = {}
    for key in ("lr", "betas", "eps"):
        values = {
            tuple(g[key]) if isinstance(g.get(key), (list, tuple)) else g.get(key) for g in groups
        }
        if len(values) > 1:
            raise CheckpointError(
                f"{where}: the param groups have different {key} ({values}); "
                "the engine steps all parameters with one"
            )
        value = values.pop()
        if value is not None:
            out[key] = float(value) if key != "betas" else tuple(float(b) for b in value)
    decays = {float(g["weight_decay"]) for g in groups if g.get("weight_decay")}
    if len(decays) > 1:
        raise CheckpointError(
            f"{where}: the param groups decay by {sorted(decays)}; the "
            "engine has one weight decay (and no_decay for the others)"
        )
    out["weight_decay"] = decays.pop() if decays else 0.0
    return [out]


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
    names under each of their names, plus the counters and lr scheduler state. Streams one
    tensor at a time; needs no process group."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    from .load import open_source

    source = open_source(directory, tag)
    try:
        extra, _ = source.extra(0)
        names = list(source.shapes)
        steps = extra["optimizer_steps"]
        missed = extra.get("missed_updates") or {}
        model: dict[str, Any] = {n: torch.empty(source.shapes[n], device="meta") for n in names}
        model.update({a: model[n] for a, n in source.aliases.items()})
        state = {
            n: {
                "step": torch.tensor(float(steps - missed.get(n, 0))),
                **{m: torch.empty(source.shapes[n], device="meta") for m in _MOMENTS},
            }
            for n in names
        }
        group = {**_ADAMW, **(extra["param_groups"] or [{}])[0], "params": names}
        sd: dict[str, Any] = {
            model_key: model,
            optim_key: {"state": state, "param_groups": [group]},
            "zero_offload": {k: extra[k] for k in ("micro_steps", "global_steps")},
        }
        if extra.get("lr_scheduler") is not None:
            sd["lr_scheduler"] = extra["lr_scheduler"]
        section_of = {f"{model_key}.{n}": (n, 0) for n in names}
        section_of.update({f"{model_key}.{a}": (n, 0) for a, n in source.aliases.items()})
        for n in names:
            for s, m in enumerate(_MOMENTS, 1):
                section_of[f"{optim_key}.state.{n}.{m}"] = (n, s)

        def fill(fqn: str, meta: torch.Tensor) -> torch.Tensor:
            name, section = section_of[fqn]
            values = torch.zeros(meta.shape, dtype=torch.float32)
            wanted: list[torch.Tensor | None] = [None, None, None]
            wanted[section] = values.view(-1)
            source.read(name, 0, values.numel(), wanted)
            return values

        _, lazy_planner = _planners()
        Path(out).mkdir(parents=True, exist_ok=True)
        save(
            sd, storage_writer=FileSystemWriter(str(out)), planner=lazy_planner(fill), no_dist=True
        )
    finally:
        source.close()
    return Path(out)
