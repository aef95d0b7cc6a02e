"""Short probes of this machine's rates for a step-time prediction (``--probe``): a GEMM's
FLOP/s in the compute dtype, the CPU Adam's params/s (``bench adam``'s kernel, the offload
path: bf16 gradients in, bf16 parameters out) and, given a folder on the swap disk, raw
O_DIRECT read and write GB/s (``bench step``'s baseline, ``bench io``'s loop). Each takes a
second or two; a shared host's load moves them, so the report says when they ran."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...optim.native import adam_kernel as K
from ...planning.step_time.hardware import PROBE_EFFICIENCY, Rates
from .io import disk_baseline

__all__ = ["ProbeResult", "probe_gemm", "probe_adam", "probe_disk", "probe"]

_GEMM_SIZE = 1024  # bf16 on a CPU: large enough for the blocked kernel's full rate
_ADAM_PARAMS = 1 << 24  # 16M params: 450 MB of traffic a step, well past the caches
_DISK_BYTES = 256 * 2**20


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


def probe_adam(threads: int | None = None, seconds: float = 1.0) -> float:
    """Params/s of the CPU Adam on the offload path (bf16 gradients in, bf16 out)."""
    n = _ADAM_PARAMS
    p = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    step = [0]
    threads = threads or K.default_num_threads()

    def adam() -> None:
        step[0] += 1
        hyper = K.AdamHyper(
            step=step[0],
            lr=1e-4,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            adamw=True,
            grad_scale=1.0,
        )
        K.adam_update(p, g, m, v, out=out, num_threads=threads, **hyper)

    return n / _median(adam, seconds)


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

    def rates(self, efficiency: float = PROBE_EFFICIENCY) -> Rates:
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
            source=(
                f"probed here: GEMM {self.gemm_flops / 1e9:.0f} GFLOP/s x {efficiency}, "
                f"Adam {self.adam_params_per_s / 1e6:.0f} Mparam/s{disk}, "
                f"{self.threads} threads, load {self.load_average:.1f}"
            ),
        )


def probe(
    nvme_path: Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seconds: float = 1.0,
    shape: tuple[int, int, int] | None = None,
) -> ProbeResult:
    """This machine's rates, each probe about ``seconds`` long (the disk: 256 MiB each way);
    ``shape``: the model's MLP matmul (``probe_gemm``)."""
    gemm = probe_gemm(dtype, seconds=seconds, shape=shape)
    adam = probe_adam(seconds=seconds)
    read = write = None
    if nvme_path is not None:
        Path(nvme_path).mkdir(parents=True, exist_ok=True)
        read, write = probe_disk(Path(nvme_path))
    return ProbeResult(gemm, adam, read, write, torch.get_num_threads(), os.getloadavg()[0])
