"""``CPUAdam`` / ``CPUAdamW``: torch optimizers whose step runs the native CPU Adam kernel.

Why not torch.optim.AdamW: for offloaded shards the update runs on the host with bf16
grads coming in and bf16 params going back to the device; the kernel does widen, update
and narrow in one pass over memory. The state layout (``step``, ``exp_avg``,
``exp_avg_sq``), param_groups and state_dict match torch's Adam so checkpoints and lr
schedulers work unchanged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .native.adam_kernel import adam_update, check_tensors

logger = logging.getLogger(__name__)


class CPUAdam(torch.optim.Optimizer):
    """Adam (``adamw=False``, L2 weight decay) or AdamW (``adamw=True``, decoupled decay)
    for fp32 CPU params, equal to ``torch.optim.AdamW`` / ``Adam`` within a few ulp.

    ``num_threads`` (default: physical cores) is how many threads split each tensor.
    ``amsgrad`` and ``maximize`` are not supported and raise ValueError.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        adamw: bool = True,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        num_threads: int | None = None,
    ) -> None:
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
        _reject_unsupported(amsgrad, maximize)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw=bool(adamw),
            amsgrad=False,
            maximize=False,
        )
        super().__init__(params, defaults)
        self.num_threads = num_threads

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            # a torch AdamW/Adam state dict says decoupled_weight_decay instead
            group.setdefault(
                "adamw", group.get("decoupled_weight_decay", self.defaults.get("adamw", True))
            )
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every param that has a ``.grad``; lr etc. are read from param_groups now."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                self._update(p, p.grad, group, None)
        return loss

    @torch.no_grad()
    def step_param(self, param: Tensor, grad: Tensor, out: Tensor | None = None) -> None:
        """Update one param with an explicitly given grad (fp32, bf16 or fp16), optionally
        writing the result as bf16/fp16 into ``out``; uses the param's group and state and
        increments its step. The engine calls this on flat master / grad shards."""
        self._update(param, grad, self._group_of(param), out)

    def _group_of(self, param: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError(
            f"param of shape {tuple(param.shape)} is not in this optimizer's param_groups"
        )

    def _update(self, p: Tensor, grad: Tensor, group: dict[str, Any], out: Tensor | None) -> None:
        _reject_unsupported(group.get("amsgrad", False), group.get("maximize", False))
        state = self.state[p]
        if len(state) == 0:
            check_tensors(p, grad, p, p, out)  # fail before creating state for a bad param
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        check_tensors(p, grad, exp_avg, exp_avg_sq, out)  # before the step count moves
        step_t = state["step"]
        step = int(step_t.item() if isinstance(step_t, Tensor) else step_t) + 1
        beta1, beta2 = group["betas"]
        adam_update(
            p,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=_scalar(group["lr"]),
            beta1=_scalar(beta1),
            beta2=_scalar(beta2),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw=group.get("adamw", True),
            out=out,
            num_threads=self.num_threads,
        )
        if isinstance(step_t, Tensor):
            step_t.fill_(step)
        else:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)


class CPUAdamW(CPUAdam):
    """``CPUAdam`` with decoupled weight decay fixed on (the ``torch.optim.AdamW`` math)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw=True,
            amsgrad=amsgrad,
            maximize=maximize,
            num_threads=num_threads,
        )


def _scalar(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _reject_unsupported(amsgrad: bool, maximize: bool) -> None:
    if amsgrad:
        raise ValueError(
            "CPUAdam does not support amsgrad=True; use torch.optim.AdamW(amsgrad=True)"
        )
    if maximize:
        raise ValueError("CPUAdam does not support maximize=True; negate the loss instead")
