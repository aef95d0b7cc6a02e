"""``bench adam``'s optimizer-state variants: our kernel for each kind and state precision,
and the 8-bit optimizers of torchao and bitsandbytes on the same CPU, when installed.

Bytes per param are the minimum each variant must move (state read and written, gradient
read, new low-precision params written), from the policy's named sizes; an 8-bit moment
counts its code and its block's absmax share.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...optim import ShardState, StateLayout, StatePolicy, StepHyper, step
from ...optim.policy import CODE_BYTES

logger = logging.getLogger(__name__)

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
OURS_FP32 = "zero_offload CPUAdam"  # the fp32 kernel's variant in `bench adam`
TORCHAO = "torchao AdamW8bit"
BNB = "bitsandbytes AdamW8bit"


@dataclass
class Variant:
    """One timed thing: a callable plus what it moves and what it is compared with."""

    path: str
    name: str
    fn: Callable[[], None]
    bytes_per_param: float
    baseline: str | None = None  # the variant its x-ratio column divides by
    ours: bool = False
    targets: dict[str, str] = field(default_factory=dict)  # label -> variant to compare with
    seconds: list[float] = field(default_factory=list)


def moved_bytes(policy: StatePolicy, grad_bytes: int, out_bytes: int) -> float:
    """Bytes per param a step must move: state in and out, grad in, params out."""
    state = policy.bytes_per_param  # read once, written once
    return 2 * state + grad_bytes + out_bytes


# (label, policy, paths): each runs with fp32 grads in place ("fp32") and with bf16 grads in,
# bf16 params out ("bf16")
_P = StatePolicy.parse
POLICIES = [
    ("adamw bf16 moments", _P("adamw", "bf16", "fp32")),
    ("adamw 8-bit", _P("adamw", "8bit", "fp32")),
    ("adamw 8-bit + bf16_sr master", _P("adamw", "8bit", "bf16_sr")),
    ("adamw 8-bit + bf16_kahan master", _P("adamw", "8bit", "bf16_kahan")),
    ("lion fp32", _P("lion", "fp32", "fp32")),
    ("lion 8-bit", _P("lion", "8bit", "fp32")),
    ("adagrad fp32", _P("adagrad", "fp32", "fp32")),
]


def kernel_variant(
    label: str,
    policy: StatePolicy,
    path: str,
    master32: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
    threads: int,
) -> Variant:
    """Our kernel stepping ``policy``'s state over ``master32``'s values (stepped in place
    where the master is fp32), ``grad`` in, ``out`` (None: none) out."""
    n = master32.numel()
    span = StateLayout.uniform(policy, n).span()
    state = ShardState.zeros(span)
    if policy.master.element_bytes == 4:
        state.master = master32  # the shared fp32 params, stepped in place like CPUAdam's
    else:
        state.master.copy_(master32)
    counter = [0]

    def fn() -> None:
        counter[0] += 1
        hyper = StepHyper(
            step=counter[0], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD
        )
        step(state, grad, hyper, out=out, num_threads=threads)

    grad_bytes = grad.element_size()
    out_bytes = 0 if out is None else out.element_size()
    targets = {"x our fp32": OURS_FP32 if path == "fp32" else f"{OURS_FP32}, fused out"}
    if policy.kind.value == "adamw" and policy.quantized and policy.master.value == "fp32":
        targets.update({"x torchao": TORCHAO, "x bitsandbytes": BNB})
    return Variant(
        path,
        f"zero_offload {label}",
        fn,
        moved_bytes(policy, grad_bytes, out_bytes),
        targets["x our fp32"],
        True,
        targets,
    )


def _foreign(p: torch.Tensor, g32: torch.Tensor, threads: int) -> list[Variant]:
    """torchao's and bitsandbytes' AdamW8bit on CPU tensors, each on a parameter of its own
    (they keep their state in the optimizer), skipped with a line when not installed."""
    out = []
    if importlib.util.find_spec("torchao") is not None:
        from torchao.optim import AdamW8bit  # type: ignore[import-untyped]

        q = torch.nn.Parameter(p.clone())
        q.grad = g32
        opt = AdamW8bit([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, block_size=256)
        out.append(Variant("fp32", TORCHAO, opt.step, 2 * (4 + 2 * CODE_BYTES) + 4 + 0.03))
    else:
        logger.warning("torchao is not installed: its AdamW8bit is left out")
    if importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes as bnb

        q2 = torch.nn.Parameter(p.clone())
        q2.grad = g32
        opt2 = bnb.optim.AdamW8bit([q2], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        out.append(Variant("fp32", BNB, opt2.step, 2 * (4 + 2 * CODE_BYTES) + 4 + 0.03))
    else:
        logger.warning("bitsandbytes is not installed: its AdamW8bit is left out")
    return out


def state_variants(
    p: torch.Tensor,
    g32: torch.Tensor,
    g16: torch.Tensor,
    threads: int,
    kinds: list[str] | None = None,
) -> list[Variant]:
    """Our kernel for each policy on both paths (``kinds``: labels to keep), then, with
    ``kinds`` None (all), torchao's and bitsandbytes' AdamW8bit."""
    out: list[Variant] = []
    out16 = torch.zeros(p.numel(), dtype=torch.bfloat16)  # one params-out buffer for all
    for path in ("fp32", "bf16"):
        for label, policy in POLICIES:
            if kinds is not None and label not in kinds:
                continue
            grad = g32 if path == "fp32" else g16
            out.append(
                kernel_variant(
                    label, policy, path, p, grad, None if path == "fp32" else out16, threads
                )
            )
    return out + (_foreign(p, g32, threads) if kinds is None else [])
