"""``torch.distributed.checkpoint`` (DCP) folders in and out, laid out as FSDP2 saves them.

An FSDP2 / torchtitan run saves ``dcp.save({"model": msd, "optim": osd})`` with ``msd, osd =
get_state_dict(model, optimizer)``: parameters under ``<model prefix><name>`` and Adam's state
under ``<optim prefix>state.<name>.{exp_avg, exp_avg_sq, step}``, hyperparameters under
``<optim prefix>param_groups.<i>.<key>`` (torchtitan keeps the model's keys at the top level
and the optimizer under ``optimizer.``). Other optimizers' state goes by torch's names for it:
Adagrad's ``sum`` (``torch.optim.Adagrad``), Lion's ``exp_avg`` (as Lion implementations for
torch keep it); the kind is read from those names, or from the record an export leaves.
:class:`DcpSource` finds the prefixes from the metadata and reads one parameter at a time in
fp32, resharded by DCP from however many ranks saved it; ``dcp_export.export_dcp`` writes any
checkpoint (this library's, DeepSpeed's) in that layout, one tensor in memory at a time, so
``dcp.load`` into an FSDP2 model's ``get_state_dict`` and ``set_state_dict`` continues the run.
The export has one param group (the engine's: one lr, betas, eps and weight decay), so the
FSDP2 optimizer must have one too.

DCP keeps non-tensor values as pickles and its own planner unpickles them with
``weights_only=False``; here they are read with ``weights_only=True`` (plain data only).
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..optim.policy import OptimizerKind, StatePolicy
from .format import CheckpointError, refusal_reason
from .source import one_param_group

__all__ = ["is_dcp", "DcpSource", "SECTION", "torch_group"]

log = logging.getLogger(__name__)

_STATE = re.compile(r"(.*?)state\.(.+)\.(exp_avg|sum)")
SECTION = {"exp_avg": 1, "exp_avg_sq": 2, "sum": 2}
"""A moment's torch name -> its section in a source's reads (master, exp_avg, exp_avg_sq)."""
_COMMON = dict(maximize=False, foreach=None, differentiable=False, fused=None)


def torch_group(kind: OptimizerKind) -> dict[str, Any]:
    """The param-group keys, beyond the engine's own, of the torch optimizer that keeps this
    kind's state (as ``get_state_dict`` saves them); Lion has none in torch."""
    if kind in (OptimizerKind.ADAMW, OptimizerKind.ADAM):
        return dict(
            _COMMON,
            amsgrad=False,
            capturable=False,
            decoupled_weight_decay=kind is OptimizerKind.ADAMW,
        )
    if kind is OptimizerKind.ADAGRAD:
        return dict(_COMMON, lr_decay=0.0, initial_accumulator_value=0.0)
    return {}


def _kind(record: Any, moments: set[str], root: Path) -> OptimizerKind:
    """The optimizer an export recorded, else the one whose state names were found."""
    if isinstance(record, dict) and "optimizer_type" in record:
        try:
            return OptimizerKind(record["optimizer_type"])
        except ValueError:
            raise CheckpointError(
                f"{root}: zero_offload.optimizer_type is {record['optimizer_type']!r}, "
                f"not one of {[k.value for k in OptimizerKind]}"
            ) from None
    if "sum" in moments:
        return OptimizerKind.ADAGRAD
    return OptimizerKind.ADAMW if "exp_avg_sq" in moments or not moments else OptimizerKind.LION


def is_dcp(root: Path) -> bool:
    return (root / ".metadata").is_file()


def _load_planner() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PlainLoadPlanner(DefaultLoadPlanner):
        """Non-tensor values read as plain data only (``weights_only=True``)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.state_dict[fqn] = torch.load(value, weights_only=True)
            except Exception as exc:
                raise CheckpointError(
                    f"DCP value {fqn!r} is not plain data (loading it could run code from the "
                    f"file): {refusal_reason(exc)}"
                ) from exc

    return PlainLoadPlanner


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
        first_state = f"{self._opt}state.{trained[0]}." if trained else "\0"
        names = {k[len(first_state) :] for k in tensors if k.startswith(first_state)}
        self.policy = StatePolicy(_kind(self._nested("zero_offload"), names, root))
        self._moments = self.policy.kind.moment_names

    def _load(self, keys: Sequence[str]) -> dict[str, Any]:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        load_planner = _load_planner()
        state: dict[str, Any] = {}
        for k in keys:
            m = self._meta[k]
            state[k] = (
                torch.empty(tuple(m.size), dtype=m.properties.dtype)
                if isinstance(m, TensorStorageMetadata)
                else None
            )
        planner = load_planner(flatten_state_dict=False, flatten_sharded_tensors=False)
        try:
            load(state, storage_reader=self._reader, planner=planner, no_dist=True)
        except CheckpointException as exc:  # DCP wraps what each rank raised
            causes = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
            ours = next((c for c in causes if isinstance(c, CheckpointError)), None)
            if ours is not None:
                raise CheckpointError(f"{self.where}: {ours}") from exc
            raise CheckpointError(
                f"{self.where}: {refusal_reason(causes[0] if causes else exc)}"
            ) from exc
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
                keys += [f"{self._opt}state.{name}.{m}" for m in self._moments]
            got = self._load(keys)
            values: list[torch.Tensor | None] = [got[keys[0]].reshape(-1).float(), None, None]
            for key, moment in zip(keys[1:], self._moments):
                values[SECTION[moment]] = got[key].reshape(-1).float()
            self._cached = (name, values)
        return self._cached[1]

    @torch.no_grad()
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
            "param_groups": one_param_group([groups[i] for i in sorted(groups)], self.where),
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
