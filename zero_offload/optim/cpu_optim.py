"""torch optimizers over the CPU kernels for every kind and state precision.

:class:`CPUOptimizer` takes the same three choices as the engine's config
(``optimizer_type``, ``moment_precision``, ``master_precision``); the named classes fix them:
:class:`CPUAdamW8bit` (bitsandbytes' ``AdamW8bit`` state), :class:`CPULion`,
:class:`CPULion8bit`, :class:`CPUAdagrad`. The parameter itself is the master: fp32
parameters for an fp32 master, bf16 parameters for ``bf16_kahan`` / ``bf16_sr``.

State per parameter (``optimizer.state[p]``) holds ``step`` and the arrays of
:class:`~.state.ShardState` by name (``exp_avg``, ``exp_avg.absmax``, ``exp_avg.side``, ...,
``compensation``), so ``state_dict()`` / ``load_state_dict()`` carry it as plain tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from .hyper import StepHyper
from .layout import StateLayout
from .policy import MasterPrecision, MomentPrecision, OptimizerKind, StatePolicy
from .state import MomentState, ShardState
from .step import step as optim_step

__all__ = ["CPUOptimizer", "CPUAdamW8bit", "CPULion", "CPULion8bit", "CPUAdagrad"]


def _scalar(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _what(saved: Mapping[str, Any]) -> str:
    """A saved parameter state's keys, and the kind whose moments they are."""
    moments = {k for k in saved if k not in ("step", "compensation") and "." not in k}
    kinds = [kind.value for kind in OptimizerKind if set(kind.moment_names) == moments]
    return ", ".join(sorted(saved)) + (f" ({' or '.join(kinds)} state)" if kinds else "")


class CPUOptimizer(torch.optim.Optimizer):
    """Any kind at any state precision, stepped by the native kernel (torch without one).

    ``betas`` / ``eps`` default per kind (Lion (0.9, 0.99), Adagrad eps 1e-10). Adagrad
    also takes ``lr_decay`` as torch's does. ``num_threads``: threads per tensor (default
    physical cores).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float = 0.0,
        *,
        optimizer_type: str = "adamw",
        moment_precision: str = "fp32",
        master_precision: str = "fp32",
        lr_decay: float = 0.0,
        num_threads: int | None = None,
    ) -> None:
        policy = StatePolicy.parse(optimizer_type, moment_precision, master_precision)
        beta_pair = policy.kind.default_betas if betas is None else (betas[0], betas[1])
        eps = policy.kind.default_eps if eps is None else eps
        if not 0.0 <= _scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(beta_pair):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
        defaults = dict(
            lr=lr, betas=beta_pair, eps=eps, weight_decay=weight_decay, lr_decay=lr_decay
        )
        super().__init__(params, defaults)
        self.policy = policy
        self.num_threads = num_threads
        self._layouts: dict[int, StateLayout] = {}

    def _master_dtype(self) -> torch.dtype:
        return torch.float32 if self.policy.master is MasterPrecision.FP32 else torch.bfloat16

    def _layout(self, numel: int) -> StateLayout:
        if numel not in self._layouts:
            self._layouts[numel] = StateLayout.uniform(self.policy, numel)
        return self._layouts[numel]

    def _check_param(self, p: Tensor) -> None:
        want = self._master_dtype()
        if p.dtype != want:
            raise TypeError(
                f"master_precision={self.policy.master.value!r} steps {want} parameters in "
                f"place (the parameter is the master); this one is {p.dtype}"
            )
        if p.device.type != "cpu" or not p.is_contiguous():
            raise ValueError("parameters must be contiguous CPU tensors")

    def _shard_state(self, p: Tensor) -> ShardState:
        """The parameter's state as views of the tensors in ``self.state[p]`` (created)."""
        state = self.state[p]
        if "step" not in state:
            fresh = ShardState.zeros(self._layout(p.numel()).span())
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for name, t in fresh.tensors():
                if name != "master":
                    state[name] = t
        return self._views(p, state)

    def _views(self, p: Tensor, state: Mapping[str, Any]) -> ShardState:
        """``state``'s tensors (every name :meth:`_state_names` gives) as the parameter's."""
        moments = {
            name: MomentState(state[name], state.get(f"{name}.absmax"), state.get(f"{name}.side"))
            for name in self.policy.moment_names
        }
        span = self._layout(p.numel()).span()
        return ShardState(span, p.reshape(-1), state.get("compensation"), moments)

    def _state_names(self) -> set[str]:
        """The keys of a stepped parameter's state: ``step`` and every array but the master."""
        fresh = ShardState.zeros(self._layout(0).span())
        return {"step"} | {name for name, _ in fresh.tensors() if name != "master"}

    def _check_state(self, p: Tensor, st: ShardState) -> None:
        fresh = dict(ShardState.zeros(self._layout(0).span()).tensors())  # dtypes only
        for name, t in st.tensors():
            if name != "master" and t.dtype != fresh[name].dtype:
                raise ValueError(
                    f"optimizer state {name!r} is {t.dtype}, this optimizer keeps "
                    f"{fresh[name].dtype} ({self.policy.describe()}): the state dict was saved "
                    "with another precision"
                )
        span = st.span
        want = {"master": span.numel, "compensation": span.numel}
        for name in self.policy.moment_names:
            want.update(
                {name: span.numel, f"{name}.absmax": span.blocks, f"{name}.side": span.side_numel}
            )
        for name, t in st.tensors():
            if t.numel() != want[name]:
                raise ValueError(
                    f"optimizer state {name!r} has {t.numel()} elements, a parameter of "
                    f"{p.numel()} elements needs {want[name]}"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a ``.grad`` (fp32, bf16 or fp16)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self._check_param(p)
                st = self._shard_state(p)
                self._check_state(p, st)
                count = int(self.state[p]["step"].item()) + 1
                hyper = StepHyper.from_group(group, count)
                optim_step(st, p.grad.contiguous().view(-1), hyper, num_threads=self.num_threads)
                self.state[p]["step"].fill_(count)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts floating-point state to each parameter's dtype; this state keeps its
        own (fp32 absmax beside bf16 parameters), so those tensors are restored as saved.

        A state dict of another kind or precision is refused (``ValueError``) before anything
        changes. Group keys the saved groups lack (``betas`` in ``torch.optim.Adagrad``'s)
        come from this optimizer's defaults, so torch's Adagrad state continues here."""
        if any(isinstance(s, dict) and "zero_offload" in s for s in state_dict["state"].values()):
            # an engine's state dict: the engine's hooks check and restore it, on any tier
            super().load_state_dict(state_dict)
            return
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        sizes = [len(g["params"]) for g in state_dict["param_groups"]]
        same = sizes == [len(g["params"]) for g in self.param_groups]
        self._check_saved(state_dict, dict(zip(saved_ids, params)) if same else {})
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, Tensor):  # a copy: never share with the source
                    self.state[p][key] = value.detach().to(device=p.device, copy=True)

    def _check_saved(self, state_dict: dict[str, Any], params: dict[Any, Tensor]) -> None:
        """Raise ``ValueError`` unless each saved parameter state is what this optimizer
        keeps (names, dtypes, sizes) and no saved group asks for what the kernels lack."""
        name = type(self).__name__
        for group in state_dict["param_groups"]:
            for key in ("maximize", "amsgrad"):  # torch options these kernels do not have
                if group.get(key):
                    raise ValueError(
                        f"the state dict's param group has {key}=True, which {name} does not "
                        f"do; load a state dict saved with {key}=False"
                    )
        want = self._state_names()
        for pid, saved in state_dict["state"].items():
            if pid not in params or not saved:
                continue  # groups that differ in size: torch's own check names them
            if set(saved) != want:
                raise ValueError(
                    f"{name}.load_state_dict: the state dict holds {_what(saved)} for parameter "
                    f"{pid}; {name} ({self.policy.describe()}) keeps {', '.join(sorted(want))}. "
                    "Load a state dict saved by an optimizer of the same kind and precisions"
                )
            self._check_state(params[pid], self._views(params[pid].detach(), saved))

    def state_fp32(self, p: Tensor) -> dict[str, Tensor]:
        """The parameter's state dequantized to fp32 (``master`` and each moment)."""
        return self._shard_state(p).to_fp32()


class CPUAdamW8bit(CPUOptimizer):
    """AdamW with 8-bit blockwise moments (bitsandbytes' ``AdamW8bit`` scheme), fp32 master."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kw: Any,
    ) -> None:
        kw.setdefault("moment_precision", MomentPrecision.INT8.value)
        super().__init__(params, lr, betas, eps, weight_decay, optimizer_type="adamw", **kw)


class CPULion(CPUOptimizer):
    """Lion (Chen et al., 2023): one momentum, sign update, decoupled weight decay."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-4,
        betas=(0.9, 0.99),
        weight_decay: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(params, lr, betas, None, weight_decay, optimizer_type="lion", **kw)


class CPULion8bit(CPULion):
    """Lion with an 8-bit blockwise momentum (bitsandbytes' ``Lion8bit`` scheme)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-4,
        betas=(0.9, 0.99),
        weight_decay: float = 0.0,
        **kw: Any,
    ) -> None:
        kw.setdefault("moment_precision", MomentPrecision.INT8.value)
        super().__init__(params, lr, betas, weight_decay, **kw)


class CPUAdagrad(CPUOptimizer):
    """Adagrad as ``torch.optim.Adagrad`` (L2 weight decay, ``lr_decay``), fp32 accumulator."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-10,
        **kw: Any,
    ) -> None:
        super().__init__(
            params,
            lr,
            None,
            eps,
            weight_decay,
            optimizer_type=OptimizerKind.ADAGRAD.value,
            lr_decay=lr_decay,
            **kw,
        )
