"""Short probes of this machine's rates for a step-time prediction (``--probe``): a GEMM's
FLOP/s in the compute dtype, a decoder block's forward and backward at the model's shape
(the share of the GEMM's rate that a step's model FLOPs reach), the CPU optimizer's params/s
on fp32 AdamW state and on the other state precisions asked for (``bench adam``'s kernels, the
offload path: bf16 gradients in, bf16 parameters out) and,
given a folder on the swap disk, raw O_DIRECT read and write GB/s (``bench step``'s baseline,
``bench io``'s loop). Each takes a second or a few; a shared host's load moves them, so the
report says when they ran."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...optim.native import default_num_threads
from ...optim.policy import StatePolicy
from ...planning.estimate.activations import DecoderShape
from ...planning.step_time.hardware import PROBE_EFFICIENCY, Rates
from ..gpt import Block, GPTConfig
from .adam_states import kernel_variant
from .io import disk_baseline

__all__ = [
    "ProbeResult",
    "probe_gemm",
    "probe_block",
    "probe_adam",
    "probe_optimizer",
    "probe_disk",
    "probe",
]

_GEMM_SIZE = 1024  # bf16 on a CPU: large enough for the blocked kernel's full rate
_ADAM_PARAMS = 1 << 24  # 16M params: 450 MB of traffic a step, well past the caches
_DISK_BYTES = 256 * 2**20
_BLOCK_SECONDS = 2.0  # one block's forward + backward at the GEMM's rate, at most
_MIN_PROBE_SEQ = 128


def _median(fn: Callable[[], None], seconds: float) -> float:
    """Median per-call seconds of ``fn`` over about ``seconds`` (after one untimed call):
    on a shared host the median is what a step will see, the best call is not."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_gemm(
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seconds: float = 1.0,
    shape: tuple[int, int, int] | None = None,
) -> float:
    """FLOP/s of a matmul in ``dtype`` on ``device``, with torch's threads as set.
    ``shape``: (tokens, width, 4 · width), a transformer MLP's, so the rate is the one the
    model's matmuls get (a small one runs well below a large square's); default a square
    large enough for the blocked kernel's full rate."""
    n = _GEMM_SIZE * (4 if device != "cpu" else 1)
    m, k, o = shape or (n, n, n)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, o, device=device).to(dtype)

    def mm() -> None:
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()

    return 2 * m * k * o / _median(mm, seconds)


def _block_flops(width: int, sequences: int, seq: int) -> float:
    """Model FLOPs of a GPT block's forward: 2 · its parameters · tokens, and the scores."""
    params = 12 * width * width + 13 * width
    return 2.0 * params * sequences * seq + 4.0 * sequences * seq * seq * width


def probe_block(
    shape: DecoderShape,
    micro_batch: tuple[int, int],
    dtype: torch.dtype = torch.bfloat16,
    gemm_flops: float | None = None,
    seconds: float = 1.0,
) -> tuple[float, tuple[int, int]]:
    """Model FLOP/s (6 · block params · tokens and the attention scores, over the time) of a
    GPT block of the model's width and heads, forward and backward on ``micro_batch``'s
    (sequences, seq) in ``dtype`` on the CPU: what a step reaches beside its matmuls (norms,
    activations, attention, casts). A micro-batch whose block would take more than about
    two seconds at ``gemm_flops`` runs fewer sequences (then shorter ones, down to 128
    tokens). Returns the rate and the (sequences, seq) it ran."""
    b, s = micro_batch
    heads = shape.heads if shape.hidden % shape.heads == 0 else 1

    def too_long(b: int, s: int) -> bool:
        seconds_at_gemm = 3 * _block_flops(shape.hidden, b, s) / (gemm_flops or float("inf"))
        return seconds_at_gemm > _BLOCK_SECONDS

    while b > 1 and too_long(b, s):
        b = max(1, b // 2)
    while s > _MIN_PROBE_SEQ and too_long(b, s):
        s = max(_MIN_PROBE_SEQ, s // 2)
    block = Block(GPTConfig(layers=1, width=shape.hidden, heads=heads, seq=s)).to(dtype)
    x = torch.randn(b, s, shape.hidden).to(dtype).requires_grad_()

    def step() -> None:
        block(x).float().sum().backward()
        x.grad = None
        block.zero_grad(set_to_none=True)

    return 3 * _block_flops(shape.hidden, b, s) / _median(step, seconds), (b, s)


def probe_optimizer(policy: StatePolicy, threads: int | None = None, seconds: float = 1.0) -> float:
    """Params/s of the CPU optimizer on ``policy``'s state, on the offload path (bf16
    gradients in, bf16 parameters out)."""
    n = _ADAM_PARAMS
    out = torch.empty(n, dtype=torch.bfloat16)
    grad = torch.randn(n).to(torch.bfloat16)
    variant = kernel_variant(
        policy.describe(),
        policy,
        "bf16",
        torch.randn(n),
        grad,
        out,
        threads or default_num_threads(),
    )
    return n / _median(variant.fn, seconds)


def probe_adam(threads: int | None = None, seconds: float = 1.0) -> float:
    """Params/s of the CPU Adam (fp32 AdamW state) on the offload path."""
    return probe_optimizer(StatePolicy(), threads, seconds)


def probe_disk(directory: Path, size: int = _DISK_BYTES) -> tuple[float, float]:
    """Raw O_DIRECT (read, write) bytes/s on ``directory``'s disk."""
    r = disk_baseline(directory, size)
    return r["read_gbps"] * 1e9, r["write_gbps"] * 1e9


@dataclass(frozen=True)
class ProbeResult:
    gemm_flops: float
    adam_params_per_s: float
    disk_read: float | None
    disk_write: float | None
    threads: int
    load_average: float
    block_flops: float | None = None  # a decoder block's model FLOP/s (None: not probed)
    block_tokens: tuple[int, int] | None = None  # the (sequences, seq) it ran
    # params/s of the CPU optimizer on other state precisions and kinds
    optimizer_rates: tuple[tuple[StatePolicy, float], ...] = ()

    @property
    def efficiency(self) -> float:
        """The share of the GEMM's rate a step's model FLOPs reach: the decoder block's, or
        ``PROBE_EFFICIENCY`` where no block was probed."""
        return self.block_flops / self.gemm_flops if self.block_flops else PROBE_EFFICIENCY

    def rates(self, efficiency: float | None = None) -> Rates:
        efficiency = self.efficiency if efficiency is None else efficiency
        disk = (
            f", disk {self.disk_read / 1e9:.2f}/{self.disk_write / 1e9:.2f} GB/s"
            if self.disk_read and self.disk_write
            else ""
        )
        return Rates(
            flops=self.gemm_flops,
            efficiency=efficiency,
            adam=self.adam_params_per_s,
            disk_read=self.disk_read,
            disk_write=self.disk_write,
            optimizer_rates=self.optimizer_rates,
            source=(
                f"probed here: GEMM {self.gemm_flops / 1e9:.0f} GFLOP/s x {efficiency:.2f}"
                f"{self._block_note()}, "
                f"Adam {self.adam_params_per_s / 1e6:.0f} Mparam/s{self._states_note()}{disk}, "
                f"{self.threads} threads, load {self.load_average:.1f}"
            ),
        )

    def _states_note(self) -> str:
        return "".join(
            f", {p.kind.value} {p.moments.value}/{p.master.value} {r / 1e6:.0f} Mparam/s"
            for p, r in self.optimizer_rates
        )

    def _block_note(self) -> str:
        if not self.block_flops or not self.block_tokens:
            return ""
        b, s = self.block_tokens
        return f" (a decoder block's {b} x {s} tokens: {self.block_flops / 1e9:.0f} GFLOP/s)"


def probe(
    nvme_path: Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seconds: float = 1.0,
    shape: tuple[int, int, int] | None = None,
    decoder: tuple[DecoderShape, tuple[int, int]] | None = None,
    policies: Sequence[StatePolicy] = (),
) -> ProbeResult:
    """This machine's rates, each probe about ``seconds`` long (the disk: 256 MiB each way);
    ``shape``: the model's MLP matmul (``probe_gemm``); ``decoder``: the model's shape and
    micro-batch, for ``probe_block``; ``policies``: optimizer states whose CPU optimizer rate
    to measure beside fp32 AdamW's (``probe_optimizer``)."""
    gemm = probe_gemm(dtype, seconds=seconds, shape=shape)
    block = block_tokens = None
    if decoder is not None:
        block, block_tokens = probe_block(*decoder, dtype=dtype, gemm_flops=gemm, seconds=seconds)
    adam = probe_adam(seconds=seconds)
    others = tuple(dict.fromkeys(p for p in policies if not p.is_default))
    states = tuple((p, probe_optimizer(p, seconds=seconds)) for p in others)
    read = write = None
    if nvme_path is not None:
        Path(nvme_path).mkdir(parents=True, exist_ok=True)
        read, write = probe_disk(Path(nvme_path))
    load = os.getloadavg()[0]
    threads = torch.get_num_threads()
    return ProbeResult(gemm, adam, read, write, threads, load, block, block_tokens, states)
