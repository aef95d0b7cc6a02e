"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3, any saved world size) read as a
:class:`~.source.Source`, without DeepSpeed installed.

A DeepSpeed save of tag ``T`` under ``DIR`` is ``DIR/latest`` (the text ``T``) and ``DIR/T/``:

    mp_rank_00_model_states.pt                  stages 1-2 (rank 0): names and shapes of the
    zero_pp_rank_<r>_mp_rank_00_model_states.pt stage 3 (every rank): flattened parameters per
                                                group, tied names, frozen parameters, buffers,
                                                step counters, lr scheduler state
    zero_pp_rank_<r>_mp_rank_00_optim_states.pt rank r's fp32 master partitions and the base
                                                optimizer's state (exp_avg, exp_avg_sq, step);
                                                a bf16 run names them bf16_zero_pp_rank_<r>_...
                                                at every stage, with the same ZeRO content

Stages 1-2 flatten each parameter group (parameters end to end, with the alignment padding
each one records) and give rank r the r-th of N equal pieces; stage 3 cuts every parameter
into N pieces of ceil(numel / N) and rank r's pieces lie end to end over its sub-groups.

The files are pickles written by someone else: they are read with
``torch.load(weights_only=True, mmap=True)``, and the few DeepSpeed classes they hold
(loss scaler records, the stage enum, fragment addresses) are allow-listed as plain stand-ins
that keep their attributes and run nothing; a file needing anything else is refused. Memory-
mapped, the partitions are paged in from the files as they are read, not held.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from ..optim.policy import OptimizerKind, StatePolicy
from ..partition import split_range
from ..policies import Stage
from .deepspeed_state import MOMENTS, saved_kind, training_state
from .format import CheckpointError, refusal_reason

__all__ = ["find_deepspeed", "DeepSpeedSource", "load_deepspeed_file"]

log = logging.getLogger(__name__)

# DeepSpeed 0.19.8 prefixes "bf16_" to every optimizer file of a bf16 run, whatever the stage
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
_REFUSED = {  # file name pattern -> what it means
    r"mp_rank_(0[1-9]|[1-9]\d)": "tensor or pipeline parallelism (model-parallel rank > 0)",
    r"expp_rank_": "mixture-of-experts expert files",
    r"^layer_\d+": "pipeline-parallel layer files",
}


class _Record:
    """Stand-in for a plain DeepSpeed object (a loss scaler, a fragment address): it keeps
    the attributes the pickle stores and has no behaviour."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


def _stage(value: int) -> int:
    """Stand-in for ``ZeroStageEnum(value)``."""
    return int(value)


_SAFE: list[Any] = [
    (_Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Record, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def load_deepspeed_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed ``.pt`` file, memory-mapped, with only tensors, plain data and the
    stand-ins above allowed; anything else is refused before it is built."""
    try:
        with torch.serialization.safe_globals(_SAFE):
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                loaded = torch.load(path, map_location="cpu", weights_only=True)  # legacy
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except Exception as exc:
        if not re.search(r"Unsupported (global|class)", str(exc)):  # not a refused object
            raise CheckpointError(
                f"{path}: unreadable, the file is truncated or corrupt (an interrupted save or "
                f"copy?): {type(exc).__name__}: {refusal_reason(exc)}; copy it again from the run"
            ) from exc
        raise CheckpointError(
            f"{path}: refused, it holds objects other than tensors, plain data and the "
            "DeepSpeed records zero_offload reads (loading it could run code from the file): "
            f"{refusal_reason(exc)}"
        ) from exc
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: holds a {type(loaded).__name__}, not a dict")
    return loaded


def _is_deepspeed(folder: Path) -> bool:
    """DeepSpeed's files are here (a folder missing some of them is named as such later)."""
    return folder.is_dir() and any(
        any(folder.glob(pattern))
        for pattern in ("*model_states.pt", "*zero_pp_rank_*_optim_states.pt")
    )


def find_deepspeed(root: Path, tag: str | None = None) -> Path | None:
    """The DeepSpeed tag folder ``root`` means: ``root/tag``, ``root`` itself, or the one
    ``root/latest`` names (as in a Trainer's ``checkpoint-N``); None when it is not one."""
    if tag is not None:
        return root / tag if _is_deepspeed(root / tag) else None
    if _is_deepspeed(root):
        return root
    latest = root / "latest"
    if latest.is_file():
        named = root / latest.read_text().strip()
        if named.name and _is_deepspeed(named):
            return named
    return None


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def _base_state(osd: dict[str, Any], stage: Stage, path: Path) -> tuple[dict, list | None]:
    """The base optimizer's per-group state and its param groups (None: elastic layout)."""
    base = osd.get("optimizer_state_dict" if stage.shards_params else "base_optimizer_state")
    if isinstance(base, list):  # stages 1-2 "elastic" layout: one lean state per group
        return dict(enumerate(base)), None
    if isinstance(base, dict) and "state" in base:
        return base["state"], base.get("param_groups")
    raise CheckpointError(f"{path}: no base optimizer state")


class _Rank:
    """One saved rank's optimizer state: fp32 master and the moments per flat group."""

    def __init__(self, path: Path, stage: Stage, kind: OptimizerKind) -> None:
        sd = load_deepspeed_file(path)
        osd = sd.get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise CheckpointError(f"{path}: no optimizer_state_dict (not a ZeRO optimizer file)")
        self.osd = osd
        self.master = list(
            osd["fp32_flat_groups" if stage.shards_params else "single_partition_of_fp32_groups"]
        )
        states, self.param_groups = _base_state(osd, stage, path)
        self.moments: list[tuple[torch.Tensor, ...]] = []
        for g in range(len(self.master)):
            state = states.get(g)
            if not isinstance(state, dict):
                raise CheckpointError(f"{path}: the optimizer state has no group {g}")
            found = [next((state[n] for n in names if n in state), None) for names in MOMENTS[kind]]
            if any(m is None for m in found):
                raise CheckpointError(
                    f"{path}: group {g}'s optimizer state holds {sorted(state)}, not the "
                    f"{kind.value} moments {[n[0] for n in MOMENTS[kind]]}; zero_offload resumes "
                    "Adam, AdamW, Lion and Adagrad state only"
                )
            self.moments.append(tuple(found))  # type: ignore[arg-type]
        self.steps = [int(states[g].get("step", 0)) for g in range(len(self.master))]

    def section(self, k: int, s: int) -> torch.Tensor | None:
        sections = (self.master[k], *self.moments[k])
        return sections[s].reshape(-1) if s < len(sections) else None


def _span(starts: list[int], lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """[lo, hi) of a concatenation of groups starting at ``starts`` (plus the end):
    (group, offset in it, count, offset in [lo, hi))."""
    out = []
    for k in range(len(starts) - 1):
        a, b = max(lo, starts[k]), min(hi, starts[k + 1])
        if a < b:
            out.append((k, a - starts[k], b - a, a - lo))
    return out


class DeepSpeedSource:
    """A DeepSpeed ZeRO checkpoint folder (``global_stepN``), read lazily rank by rank."""

    def __init__(self, folder: Path) -> None:
        self.where, self.tag = folder, folder.name
        for pattern, what in _REFUSED.items():
            hit = next((p.name for p in folder.iterdir() if re.search(pattern, p.name)), None)
            if hit:
                raise CheckpointError(f"{folder / hit}: {what} is not supported")
        if (folder / "offloaded_tensors").exists():
            raise CheckpointError(
                f"{folder / 'offloaded_tensors'}: DeepSpeed kept this run's optimizer state in "
                "NVMe swap files, which zero_offload does not read; resave it from DeepSpeed with "
                "offload_optimizer.device 'cpu' or 'none'"
            )
        files = {int(m.group(1)): p for p in folder.iterdir() if (m := _OPTIM.fullmatch(p.name))}
        if not files:
            raise CheckpointError(
                f"{folder}: no [bf16_]zero_pp_rank_*_optim_states.pt files; only ZeRO stage 1-3 "
                "checkpoints carry partitioned optimizer state (stage 0 stores no names for it)"
            )
        self._files = [files.get(r) for r in range(max(files) + 1)]
        first = load_deepspeed_file(self._files[0] or folder / "zero_pp_rank_0")
        osd = first.get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise CheckpointError(f"{self._files[0]}: no optimizer_state_dict")
        if "zero_stage" not in osd:  # BF16_Optimizer writes the same file names, no stage
            raise CheckpointError(
                f"{self._files[0]}: DeepSpeed's BF16_Optimizer state (bf16 with ZeRO stage 0: "
                "no zero_stage in the file) is not supported; resave the run with "
                "zero_optimization.stage 1, 2 or 3, or load its weights alone (DeepSpeed's "
                "zero_to_fp32.py) and start the optimizer afresh"
            )
        self.stage = int(osd["zero_stage"])
        try:
            self.sharding = Stage(self.stage)
        except ValueError:
            self.sharding = Stage.REPLICATED  # refused below, naming the number read
        counts = osd.get("partition_count")
        counts = set(counts) if isinstance(counts, list) else {counts}
        if len(counts) != 1 or not self.sharding.sharded:
            raise CheckpointError(f"{folder}: ZeRO stage {self.stage}, partition counts {counts}")
        self.world = int(counts.pop())
        missing = [r for r in range(self.world) if r >= len(self._files) or not self._files[r]]
        if missing or len(self._files) != self.world:
            raise CheckpointError(
                f"{folder}: saved by {self.world} ranks but the optimizer files of ranks "
                f"{missing or list(range(self.world, len(self._files)))} are missing or extra "
                "(an incomplete or overwritten save)"
            )
        name = (
            "zero_pp_rank_0_mp_rank_00_model_states.pt"
            if self.sharding.shards_params
            else "mp_rank_00_model_states.pt"
        )
        if not (folder / name).is_file():
            raise CheckpointError(
                f"{folder / name}: missing: this DeepSpeed save has its optimizer files but not "
                "the model states file that names and shapes the parameters; copy it from the run"
            )
        self.model = load_deepspeed_file(folder / name)
        self.config = self.model.get("ds_config") or {}
        self._ranks: dict[int, _Rank] = {}
        self.aliases = dict(self.model.get("shared_params") or {})
        self.optional: set[str] = set()
        states, groups = _base_state(osd, self.sharding, self._files[0])  # type: ignore[arg-type]
        self.policy = StatePolicy(saved_kind(states, groups, self.config))  # fp32 moments
        self._layout()
        log.info(
            "DeepSpeed %s checkpoint %s: ZeRO stage %d, %d ranks, %d parameters",
            self.model.get("ds_version", "?"),
            folder,
            self.stage,
            self.world,
            len(self.shapes),
        )

    def rank(self, r: int) -> _Rank:
        if r not in self._ranks:
            path = self._files[r]
            self._ranks[r] = _Rank(path, self.sharding, self.policy.kind)  # type: ignore[arg-type]
        return self._ranks[r]

    # -- where each parameter is --------------------------------------------------------------
    def _layout(self) -> None:
        groups = self.model.get("param_shapes")
        if not isinstance(groups, list):
            raise CheckpointError(f"{self.where}: model states without param_shapes")
        r0 = self.rank(0)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple] = {}
        self._group_of: dict[str, int] = {}
        if self.sharding.shards_params:
            sizes = [t.numel() for t in r0.master]
            self._starts = [0, *[sum(sizes[: k + 1]) for k in range(len(sizes))]]
            offset = 0
            for shapes in groups:
                for name, shape in shapes.items():
                    part = math.ceil(_numel(shape) / self.world)
                    self._add(name, shape, ("part", offset, part))
                    offset += part
            if offset != self._starts[-1]:
                raise CheckpointError(
                    f"{self.where}: the parameters need {offset} elements per rank, the fp32 "
                    f"groups hold {self._starts[-1]} (a damaged checkpoint)"
                )
        else:
            paddings = r0.osd.get("param_alignment_paddings") or [None] * len(groups)
            for g, shapes in enumerate(groups):
                offset, pads = 0, paddings[g] or [0] * len(shapes)
                part = r0.master[g].numel()
                for (name, shape), pad in zip(shapes.items(), pads):
                    self._add(name, shape, ("flat", g, offset, part))
                    offset += _numel(shape) + pad
                if offset > part * self.world:
                    raise CheckpointError(
                        f"{self.where}: group {g} holds {offset} elements of "
                        f"{part * self.world} (a damaged checkpoint)"
                    )
        self._frozen()

    def _add(self, name: str, shape: Any, where: tuple) -> None:
        self.shapes[name] = tuple(int(d) for d in shape)
        self._where[name] = where

    def _frozen(self) -> None:
        """Parameters outside the optimizer: their values, no moments."""
        shapes = self.model.get("frozen_param_shapes")
        if shapes is not None:  # stages 2-3 list them; stage 3 stores each rank's piece
            for name, shape in shapes.items():
                if self.sharding.shards_params:
                    self._add(name, shape, ("frozen3", math.ceil(_numel(shape) / self.world)))
                else:
                    self._add(name, shape, ("whole", self.model["frozen_param_fragments"][name]))
            return
        module = self.model.get("module") or {}
        skip = set(self.shapes) | set(self.aliases) | set(self.model.get("buffer_names") or ())
        for name, value in module.items():  # stage 1: the module state dict holds them
            if name not in skip and isinstance(value, torch.Tensor):
                self._add(name, value.shape, ("whole", value))

    def _frozen_piece(self, r: int, name: str) -> torch.Tensor:
        if r == 0:
            return self.model["frozen_param_fragments"][name].reshape(-1)
        path = self.where / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        return load_deepspeed_file(path)["frozen_param_fragments"][name].reshape(-1)

    # -- Source --------------------------------------------------------------------------------
    @torch.no_grad()  # stored tensors may require grad (frozen parameters' fragments)
    def read(self, name: str, start: int, end: int, out: Sequence[torch.Tensor | None]) -> None:
        where = self._where[name]
        kind = where[0]
        if kind in ("whole", "frozen3"):  # no moments
            if out[0] is None:
                return
            if kind == "whole":
                out[0].copy_(where[1].reshape(-1)[start:end])
            for r, a, b in split_range(start, end, where[1]) if kind == "frozen3" else ():
                lo = a - r * where[1]
                out[0][a - start : b - start].copy_(self._frozen_piece(r, name)[lo : lo + b - a])
            return
        if kind == "flat":  # stages 1-2: rank r holds [r * part, (r + 1) * part) of the group
            _, g, offset, part = where
            for r, a, b in split_range(offset + start, offset + end, part):
                at, lo = a - offset - start, a - r * part
                self._copy(r, g, lo, b - a, out, at)
            return
        _, offset, part = where  # stage 3: rank r holds [r * part, (r + 1) * part) of each
        for r, a, b in split_range(start, end, part):
            lo = offset + a - r * part
            for k, at_k, count, at in _span(self._starts, lo, lo + b - a):
                self._copy(r, k, at_k, count, out, a - start + at)

    def _copy(self, r: int, k: int, lo: int, count: int, out: Sequence[Any], at: int) -> None:
        for s, array in enumerate(out):
            section = self.rank(r).section(k, s) if array is not None else None
            if section is not None:  # a kind with fewer moments leaves the rest as they are
                array[at : at + count].copy_(section[lo : lo + count])

    def _param_steps(self) -> dict[str, int]:
        """Each trainable parameter's Adam step count: its group's (stages 1-2) or
        sub-group's (stage 3)."""
        r0 = self.rank(0)
        steps = list(r0.steps)
        if r0.param_groups and not any(steps):  # optimizers that keep the count in the group
            steps = [int(g.get("step", 0)) for g in r0.param_groups for _ in g["params"]]
        out = {}
        for name, where in self._where.items():
            if where[0] == "flat":
                out[name] = steps[where[1]]
            elif where[0] == "part":
                starts = self._starts
                k = max(i for i in range(len(starts) - 1) if starts[i] <= where[1])
                out[name] = steps[k]
        return out

    def extra(self, rank: int) -> tuple[dict[str, Any], bool]:
        r0 = self.rank(0)
        state = training_state(self.model, r0.osd, r0.param_groups, self._param_steps(), self.where)
        return state, False

    def close(self) -> None:
        self._ranks.clear()
