"""Stage 3: gather a module's parameters just before it runs, free them after, prefetch ahead.

Forward: a pre-hook on every module that holds parameters gathers its units; a post-hook frees
them. The order of units used in one forward is recorded; on later steps the next
``prefetch_depth`` uses (capped by ``prefetch_bytes``) are all-gathered asynchronously while the
current module computes. Backward needs parameters again only where autograd saved them, so the
saved-tensor hooks installed around the forward tag every saved tensor that lives in a gathered
unit; unpacking one re-gathers its unit (and prefetches the units used before it in the
forward). The gradient reducer frees a unit once all its gradients are reduced.

With parameters on NVMe the reads run ``prefetch_depth`` modules ahead and the all-gathers one
module less: a gather waits for its read, and every rank issues its collectives in the same
order whatever its disk does.

On CUDA a gather ahead — the shard's copy to the device on the host-to-device stream, the
all-gather on the gather stream — overlaps the running module's kernels; the compute stream
waits for it (on the device) only when the module that needs it is about to run.

Recomputation (``torch.utils.checkpoint``) re-enters the forward hooks during backward; there
they gather but do not free, because the recomputed saved tensors still point at the unit.

Frozen units, which no reduction releases, are released once their module's backward is done
(``autograd_side``). Modules run outside the engine's forward (e.g. a ``generate()`` loop)
gather and free without recording the order.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.profiler import record_function

from ..interrupts import holds_signals
from ..swap.budget import FreedMemory
from ..weak import weak_hook
from .autograd_side import (
    SavedInUnit,
    check_not_capturing,
    release_after_backward,
    storage_key,
)
from .external import ExternalUses, ReleasedAccess
from .module_units import ModuleUnits, RunningModule
from .order import MODULE, UNIT, OrderCheck
from .released import gather_when_missing
from .store import ParamStore
from .unit_state import GatherState, UnitStates
from .units import FlatUnit

__all__ = ["ParamGatherer"]

log = logging.getLogger(__name__)


class ParamGatherer:
    def __init__(
        self,
        model: nn.Module,
        units: list[FlatUnit],
        states: UnitStates,
        store: ParamStore,
        *,
        prefetch_depth: int,
        prefetch_bytes: int | None,
    ) -> None:
        self.states = states  # each unit's gather state, and the engine's pass
        self.store = store
        self.streams = store.streams
        self.prefetch_depth = prefetch_depth
        self.prefetch_bytes = prefetch_bytes
        self.units = units
        # sharded parameters: where a released one is found when a torch call takes it
        self._param_unit = {id(p): u for u in units if u.sharded_params for p in u.params}
        self._param_name = {id(p): n for u in units for p, n in zip(u.params, u.names)}
        self._module_name = {m: n or type(model).__name__ for n, m in model.named_modules()}
        tables = ModuleUnits(model, units, self._module_name)
        self.module_units = tables.own
        self.declared = tables.declared  # gathered with the module
        self.learned: dict[nn.Module, list[FlatUnit]] = {}  # found used while it ran
        self._by_ptr: dict[int, FlatUnit] = {}
        self.recorded = []  # unit indices in the order the last forward used them
        self._current: list[int] = []
        self._order_matches = True
        self.order_changes = 0
        # a use found at run time moves its unit's gather to the module's start from the next
        # forward on: that forward's new order is expected, not the data's doing
        self._learned_since = self._expect_new_order = False
        self.on_demand = 0  # gathers a torch call on a released parameter asked for
        self._external_uses = ExternalUses()
        self._frames: list[RunningModule] = []
        self._access = ReleasedAccess(self._is_released, self._on_access)
        self._access_on = False
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self._freed = FreedMemory()  # backward: pages freed with released units go back
        # Every module that holds parameters, directly or below: a use found at run time is
        # charged to the innermost running one, and released when it returns.
        hooked = [
            m
            for m in model.modules()
            if m is model or m in self.declared or next(m.parameters(), None) is not None
        ]
        self._module_id = {m: i for i, m in enumerate(model.modules())}
        self._modules = list(model.modules())
        self.order = OrderCheck(states.comm, self.streams.device, self._describe)
        self._sharded = [p for u in units if u.sharded_params for p in u.params]
        gather_when_missing(self._sharded, weak_hook(self._gather_in_backward))
        self._hooks = []
        for module in hooked:  # weak: a hook must not keep the engine alive
            self._hooks.append(
                module.register_forward_pre_hook(weak_hook(self._pre_forward), with_kwargs=True)
            )
            self._hooks.append(
                module.register_forward_hook(weak_hook(self._post_forward), always_call=True)
            )

    @property
    def recorded(self) -> list[int]:
        """Unit indices in the order the last forward used them."""
        return self._recorded

    @recorded.setter
    def recorded(self, order: list[int]) -> None:
        self._recorded = order
        # where each unit was used last: backward gathers ahead what came before it
        self._last_use = {index: at for at, index in enumerate(order)}

    def _describe(self, kind: int, ident: int) -> str:
        if kind == MODULE:
            return f"runs module {self._module_name[self._modules[ident]]!r}"
        if kind == UNIT:
            return f"gathers parameter {self.units[ident].names[0]!r} on use"
        return "ended its forward"

    # -- gather / free bookkeeping ---------------------------------------------------------
    @record_function("zero_offload.gather")
    @holds_signals
    def _fetch(self, unit: FlatUnit, wait: bool) -> None:
        """All-gather the unit from the ranks' shards (``wait``: before returning)."""
        if self.states.gather_state(unit) is GatherState.FREE:
            one_rank = self.states.comm.world_size == 1
            if wait or one_rank:  # done with the shard at once, or (one rank) it is the unit
                shard, copied, give_back, kept = self.store.lend(unit, keep=one_rank)
            else:  # an all-gather ahead keeps no pool buffer that a read may need
                (shard, copied), give_back, kept = self.store.load(unit), None, False
            self.states.gather(unit, shard, wait=wait, after=copied, then=give_back, share=kept)
            self._by_ptr[storage_key(unit.full)] = unit
            self.gathered_bytes += unit.full_bytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        if wait:
            self.states.wait(unit)

    @holds_signals
    def release(self, unit: FlatUnit) -> None:
        if self.states.gather_state(unit) is not GatherState.FREE and unit.sharded_params:
            self._by_ptr.pop(storage_key(unit.full), None)
            self.states.free(unit)
            self.gathered_bytes -= unit.full_bytes
            if self.states.in_backward:  # see FreedMemory: the forward's pages are reused
                self._freed.freed(unit.full_bytes)

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    @contextlib.contextmanager
    def lend_values(self, units: list[FlatUnit]) -> Iterator[None]:
        """Until the block ends, point each parameter of ``units`` at a copy of its gathered
        values (then back at its released view): reads see the values, and tensors taken
        from them stay valid afterwards. Collective: every rank gathers the same units, in
        unit order, one at a time (memory: the copies plus one gathered unit)."""
        units = sorted(
            {id(u): u for u in units if u.sharded_params}.values(), key=lambda u: u.index
        )
        lent: list[FlatUnit] = []
        try:
            for unit in units:
                was_free = self.states.gather_state(unit) is GatherState.FREE
                self._fetch(unit, wait=True)
                for p, view in zip(unit.params, unit.views):
                    p.data = view.clone()
                lent.append(unit)
                if was_free:
                    self.release(unit)
            yield
        finally:
            for unit in lent:
                for p, view in zip(unit.params, unit.views):
                    p.data = view

    def reset_peak(self) -> None:
        self.peak_gathered_bytes = self.gathered_bytes

    def _prefetch(self, candidates: list[int], reads_only: bool = False) -> None:
        """Gather ahead the first ``prefetch_depth`` of ``candidates`` within the byte cap.
        With parameters on NVMe only the reads start for the last of them (or for all, with
        ``reads_only``): a gather waits for its read, so it is issued one module later than
        the read, which then has a module's computation to finish in. One rank of a CPU
        device only reads ahead: its gather takes the shard's memory at once, so one ahead
        would wait for the read sooner and hold a buffer that the next read ahead needs."""
        budget = self.prefetch_bytes
        at_once = self.states.comm.world_size == 1 and not self.streams.cuda
        gathers = 0 if reads_only or at_once else self.prefetch_depth - self.store.reads_from_disk
        for taken, index in enumerate(candidates[: self.prefetch_depth]):
            unit = self.units[index]
            if self.states.gather_state(unit) is not GatherState.FREE or (
                self.states.in_backward and self.states.grads_reduced(unit)
            ):
                continue
            if budget is not None:
                if unit.full_bytes > budget:
                    break
                budget -= unit.full_bytes
            if taken < gathers:
                self._fetch(unit, wait=False)
            else:
                self.store.prefetch(unit)

    # -- forward hooks ---------------------------------------------------------------------
    def _note_use(self, indices: list[int]) -> None:
        """Record units used by the engine's forward in order, and prefetch what followed
        them last time."""
        start = len(self._current)
        self._current.extend(indices)
        expected = self.recorded[start : start + len(indices)]
        if self._order_matches and self.recorded and expected != indices:
            self._order_matches = False
            if self._expect_new_order:
                return
            self.order_changes += 1
            log.warning(
                "stage 3: the modules ran in a different order than in the last "
                "forward; prefetching is off for this step and the new order is "
                "recorded (data-dependent control flow costs speed, not results)"
            )
        if self._order_matches and self.recorded:
            after = start + len(indices)  # a few entries: the order is as long as the model
            self._prefetch(self.recorded[after : after + self.prefetch_depth])

    def _pre_forward(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        frame = RunningModule(module)
        if not self._frames:
            check_not_capturing()
        self._frames.append(frame)
        if not self._access_on:
            self._access.__enter__()
            self._access_on = frame.entered = True
        units = self.module_units.get(module, []) + self.declared.get(module, [])
        # and what it was found using while it ran before: gathered with it, as if declared
        # (on one rank a unit prefetched for that use is gathered by then, so the use alone
        # would not be seen and the recorded order would flip from step to step)
        units += [u for u in self.learned.get(module, []) if u not in units]
        frame.units = units
        if units and self.states.in_forward:  # not recomputation, not e.g. generate()
            self.order.check(MODULE, self._module_id[module])
            self._note_use([u.index for u in units])
        for unit in units:
            self._fetch(unit, wait=True)
        frozen = [u for u in units if u.frozen]
        if frozen and not self.states.in_backward and torch.is_grad_enabled():
            return release_after_backward(self, frozen, args, kwargs)
        return None

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # Also runs when the forward raised (``always_call``), so the frames stay balanced.
        if not self._frames or self._frames[-1].module is not module:
            return  # the pre-hook raised before its frame was pushed
        frame = self._frames.pop()
        if not self.states.in_backward:
            held = {id(u) for f in self._frames for u in f.units}
            for unit in frame.units + frame.borrowed:
                if id(unit) not in held:
                    self.release(unit)
        if frame.entered:
            self._access.__exit__(None, None, None)
            self._access_on = False

    @contextlib.contextmanager
    def hold(self, module: nn.Module) -> Iterator[None]:
        """Inside a forward: ``module``'s units gathered for the block, as while it runs, for
        code that uses its parameters without calling it (the tiled loss's tiles)."""
        self._pre_forward(module, (), {})
        try:
            yield
        finally:
            self._post_forward(module, (), None)

    # -- parameters used outside their module ------------------------------------------------
    def _is_released(self, key: int) -> bool:
        unit = self._param_unit.get(key)
        return unit is not None and self.states.gather_state(unit) is not GatherState.GATHERED

    def _on_access(self, param: nn.Parameter) -> None:
        """A torch call is about to read ``param`` while its unit is not gathered: gather it
        for the running module (released with it), and remember that the module uses it."""
        unit = self._param_unit[id(param)]
        frame = self._frames[-1] if self._frames else None
        if frame is not None:
            module = frame.module
            known = (
                unit in frame.units
                or unit in self.learned.get(module, [])
                or unit in self.declared.get(module, [])
            )
            if not known:
                self.learned.setdefault(module, []).append(unit)
                self._learned_since = True
                self._external_uses.note(self._module_name[module], self._param_name[id(param)])
        if self.states.in_forward:
            self.order.check(UNIT, unit.index)
            self._note_use([unit.index])
        if self.states.gather_state(unit) is GatherState.FREE:
            self.on_demand += 1
        self._fetch(unit, wait=True)
        if frame is not None and not self.states.in_backward:
            frame.borrowed.append(unit)

    def _gather_in_backward(self, param: nn.Parameter) -> bool:
        """A released parameter read outside the access mode: gathered while a backward runs
        (see ``released``), refused otherwise."""
        if not self.states.in_backward:
            return False
        self._on_access(param)
        return True

    # -- saved tensors (backward) -------------------------------------------------------------
    def pack_saved(self, tensor: torch.Tensor) -> Any:
        if self._by_ptr:
            unit = self._by_ptr.get(storage_key(tensor))
            if unit is not None:
                return SavedInUnit(unit, tensor)
        return tensor

    def unpack_saved(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, SavedInUnit):
            return packed
        unit = packed.unit
        if self.states.gather_state(unit) is not GatherState.GATHERED:
            self._fetch(unit, wait=True)
            last = self._last_use.get(unit.index)
            if self.states.in_backward and self._order_matches and last is not None:
                before = self.recorded[max(0, last - self.prefetch_depth) : last]
                self._prefetch(before[::-1])
        return packed.tensor

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The context one forward pass of the engine runs in."""
        check_not_capturing()
        self._current = []
        self._order_matches = True
        self._expect_new_order, self._learned_since = self._learned_since, False
        self.states.begin_forward()
        ok = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack_saved, self.unpack_saved):
                yield
            ok = True
        finally:
            self.states.end_pass()
            if not self._order_matches or not self.recorded:
                self.recorded = list(self._current)
            self.release_all()  # prefetched units the forward did not use after all
        if ok:  # a rank that raised leaves at once: its peers' collectives then fail too
            self.order.end()

    def prefetch_first(self) -> None:
        """After a step: start the next forward's first reads (params on NVMe) so that its
        first modules do not wait on the disk."""
        if self.store.reads_from_disk and self.recorded:
            self._prefetch(self.recorded[: self.prefetch_depth], reads_only=True)

    def begin_backward(self) -> None:
        """After the reducer's ``begin_backward``, which puts the units into BACKWARD."""
        check_not_capturing()
        if not self._access_on:  # recomputation and custom backward functions may read params
            self._access.__enter__()
            self._access_on = True

    def end_backward(self) -> None:
        self.states.end_pass()
        if self._access_on and not self._frames:
            self._access.__exit__(None, None, None)
            self._access_on = False
        self.release_all()
        self.store.drop_prefetched()

    def remove_hooks(self) -> None:
        gather_when_missing(self._sharded, None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
