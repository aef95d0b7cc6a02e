"""The rates a step-time prediction divides by, and named hardware to take them from.

A :class:`Rates` is what one rank's step runs at: the device's FLOP/s, the PCIe link, the
collectives' bandwidth, and the node's disk and CPU optimizer (shared by the node's ranks).
Rates come from short probes on this machine (``zero_offload.bench.micro.probe``) or from the
tables below for target hardware. Every figure in the tables is a vendor's datasheet number
(the source is named beside it); what a training step reaches of a peak is a separate factor
(``efficiency``), so that the table stays the datasheet's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...optim.policy import StatePolicy

__all__ = [
    "Rates",
    "Gpu",
    "GPUS",
    "PCIE",
    "NVME_DRIVES",
    "GPU_EFFICIENCY",
    "PROBE_EFFICIENCY",
    "HOST_ADAM",
    "ADAM_BYTES_PER_PARAM",
    "target_rates",
]

PROBE_EFFICIENCY = 0.75
"""Share of the GEMM probe's FLOP/s that a training step's model FLOPs (6 · params · tokens)
reach on a CPU device, where the probe knows no model shape to measure it on (with one, a
decoder block's forward and backward measure it: ``probe_block``). It depends on the host:
the 1.02B GPT of docs/step_time.md ran its forward at 0.71 and its backward at 0.80 of a
2-thread bf16 GEMM's rate on a Zen 4 host with native bf16 (norms, activations, the loss and
the engine's hooks take the rest), at 0.93 on an Ice Lake host whose bf16 GEMM is 7x slower."""

GPU_EFFICIENCY = 0.45
"""Share of a GPU's dense datasheet peak that a training step's model FLOPs reach (model
FLOPs utilization): large dense decoders train at 0.4-0.55 of peak bf16 on A100 / H100 in
published runs (PaLM reports 0.46 MFU, Llama 3 0.38-0.43 on H100); 0.45 is the middle."""

ADAM_BYTES_PER_PARAM = 28
"""Bytes the fused CPU Adam moves per parameter (docs/cpu_adam.md): the memory traffic
that bounds it, and so what a host pass over one byte per parameter costs beside it."""

HOST_ADAM = 5e9
"""Params/s of the CPU Adam on a GPU server's host, by default: it is memory-bound at 28
bytes a parameter, and 5e9 params/s is 140 GB/s, a one-socket DDR4-3200 / DDR5 server's
achievable stream bandwidth. Measure yours with ``zero-offload bench adam`` (or ``--probe``)."""


@dataclass(frozen=True)
class Rates:
    """What a step runs at. Bytes and FLOPs per second; ``disk_*`` and ``adam`` per node
    (its ranks share them), the rest per rank. ``pcie`` None: the device is the CPU itself
    (no host-device link; the optimizer and the model share the cores)."""

    flops: float  # FLOP/s of the device in the compute dtype (a GEMM's, or the datasheet's)
    efficiency: float  # share of ``flops`` a training step's model FLOPs reach
    adam: float  # params/s of the CPU optimizer, all of a node's cores
    disk_read: float | None = None  # bytes/s of the node's swap disk (None: no disk)
    disk_write: float | None = None
    pcie: float | None = None  # bytes/s per direction per GPU (None: a CPU device)
    interconnect: float | None = None  # bytes/s per rank of all-gather / reduce-scatter
    device_memory: float | None = None  # bytes/s of the device's memory (its own Adam)
    # params/s of the CPU optimizer on other state precisions and kinds, as measured
    optimizer_rates: tuple[tuple[StatePolicy, float], ...] = ()
    source: str = ""  # where these came from, for the report

    def __post_init__(self) -> None:
        for name in ("flops", "efficiency", "adam"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    def adam_for(self, policy: StatePolicy) -> float:
        """Params/s of the CPU optimizer on ``policy``'s state: as measured (``--probe``
        measures the plan's), else ``adam``, the fp32 kernel's. Smaller states move fewer
        bytes, but on a few cores 8-bit moments are bound by their compute and step slower
        than fp32 (docs/optimizer_states.md), so only a measurement says which."""
        measured = self.measured_rate(policy)
        return self.adam if measured is None else measured

    def measured_rate(self, policy: StatePolicy) -> float | None:
        """``policy``'s params/s in ``optimizer_rates``, None where it was not measured."""
        return dict(self.optimizer_rates).get(policy)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "optimizer_rates"}
        out["optimizer_rates"] = [
            {
                "optimizer_type": p.kind.value,
                "moment_precision": p.moments.value,
                "master_precision": p.master.value,
                "params_per_s": rate,
            }
            for p, rate in self.optimizer_rates
        ]
        return out

    @property
    def cpu_device(self) -> bool:
        return self.pcie is None

    @property
    def host_memory(self) -> float:
        """Host memory bytes/s, as the CPU Adam (memory-bound) reaches it."""
        return ADAM_BYTES_PER_PARAM * self.adam

    @property
    def step_flops(self) -> float:
        """FLOP/s a training step's model FLOPs run at."""
        return self.flops * self.efficiency


@dataclass(frozen=True)
class Gpu:
    """A GPU's datasheet figures: dense bf16 tensor FLOP/s (no sparsity), memory, its host
    link and, where it has one, its NVLink bandwidth per direction."""

    name: str
    bf16_flops: float
    memory_bytes: int
    memory_bandwidth: float
    pcie_gen: int
    nvlink: float | None  # bytes/s per direction per GPU; None: collectives over PCIe
    source: str


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        # NVIDIA Ada GPU architecture whitepaper v2.1, appendix table 2 (GeForce RTX 4090):
        # 165.2 TFLOPS peak BF16 tensor with FP32 accumulate (dense), 1008 GB/s GDDR6X
        Gpu("rtx4090", 165.2e12, 24 * 10**9, 1008e9, 4, None, "Ada whitepaper, table 2"),
        # NVIDIA Ampere GA102 whitepaper, table 9 (GeForce RTX 3090): 71 TFLOPS BF16 dense
        Gpu("rtx3090", 71e12, 24 * 10**9, 936e9, 4, None, "GA102 whitepaper, table 9"),
        # NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS BF16 dense; NVLink 600 GB/s
        # (both directions); 40GB 1555 GB/s, 80GB 2039 GB/s HBM
        Gpu("a100-40gb", 312e12, 40 * 10**9, 1555e9, 4, 300e9, "A100 datasheet"),
        Gpu("a100-80gb", 312e12, 80 * 10**9, 2039e9, 4, 300e9, "A100 datasheet"),
        # NVIDIA H100 Tensor Core GPU datasheet: SXM 989 TFLOPS BF16 dense (1979 sparse),
        # 3.35 TB/s, NVLink 900 GB/s; PCIe card 756 TFLOPS, 2 TB/s, NVLink bridge 600 GB/s
        Gpu("h100", 989e12, 80 * 10**9, 3350e9, 5, 450e9, "H100 datasheet (SXM)"),
        Gpu("h100-pcie", 756e12, 80 * 10**9, 2000e9, 5, 300e9, "H100 datasheet (PCIe)"),
        # NVIDIA H200 datasheet: 989 TFLOPS BF16 dense, 141 GB at 4.8 TB/s, NVLink 900 GB/s
        Gpu("h200", 989e12, 141 * 10**9, 4800e9, 5, 450e9, "H200 datasheet"),
        # NVIDIA L40S datasheet: 362.05 TFLOPS BF16 dense (733 sparse), 48 GB at 864 GB/s
        Gpu("l40s", 362.05e12, 48 * 10**9, 864e9, 4, None, "L40S datasheet"),
        # NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (242 sparse), 24 GB at 300 GB/s
        Gpu("l4", 121e12, 24 * 10**9, 300e9, 4, None, "L4 datasheet"),
        # NVIDIA A10 datasheet: 125 TFLOPS BF16 dense (250 sparse), 24 GB at 600 GB/s
        Gpu("a10", 125e12, 24 * 10**9, 600e9, 4, None, "A10 datasheet"),
    )
}

# PCIe x16, bytes/s per direction that a pinned-memory copy reaches: the PCI-SIG link rate
# (gen3 8 GT/s, gen4 16, gen5 32; 128b/130b: 15.75 / 31.5 / 63 GB/s) less packet overhead,
# about 0.8 of it as CUDA's bandwidthTest reports on such links.
PCIE: dict[int, float] = {3: 12.5e9, 4: 25e9, 5: 50e9}

# Sequential 128 KiB read / write, bytes/s, from the vendors' datasheets. Consumer drives
# write at this rate into their SLC cache only; sustained writes past it run slower (measure
# yours with ``zero-offload bench io``).
NVME_DRIVES: dict[str, tuple[float, float, str]] = {
    "samsung-990pro": (7.45e9, 6.9e9, "Samsung 990 PRO datasheet (2 TB)"),
    "samsung-980pro": (7.0e9, 5.1e9, "Samsung 980 PRO datasheet (1 TB)"),
    "wd-sn850x": (7.3e9, 6.6e9, "WD_BLACK SN850X datasheet (2 TB)"),
    "samsung-pm9a3": (6.9e9, 4.1e9, "Samsung PM9A3 U.2 datasheet (3.84 TB)"),
    "intel-p5800x": (7.2e9, 6.2e9, "Intel Optane P5800X datasheet"),
    "crucial-t700": (12.4e9, 11.8e9, "Crucial T700 datasheet (2 TB, PCIe 5)"),
}


def target_rates(
    gpu: str,
    *,
    pcie: int | None = None,
    nvme: str | None = None,
    nvme_read: float | None = None,
    nvme_write: float | None = None,
    adam: float | None = None,
    interconnect: float | None = None,
    efficiency: float | None = None,
    drives: int = 1,
) -> Rates:
    """The rates of a named GPU (``GPUS``) with its PCIe generation (default the GPU's),
    a named NVMe drive or explicit disk rates (``drives`` of them striped per node), the
    CPU Adam's params/s per node (default :data:`HOST_ADAM`) and the collectives' bytes/s
    (default NVLink where the GPU has it, else the PCIe link)."""
    g = GPUS.get(gpu.lower())
    if g is None:
        raise ValueError(f"unknown GPU {gpu!r}: choose one of {', '.join(GPUS)}")
    gen = g.pcie_gen if pcie is None else pcie
    if gen not in PCIE:
        raise ValueError(f"PCIe generation {gen!r}: choose one of {', '.join(map(str, PCIE))}")
    read, write, parts = nvme_read, nvme_write, [g.name, f"PCIe {gen}"]
    if nvme is not None:
        drive = NVME_DRIVES.get(nvme.lower())
        if drive is None:
            raise ValueError(f"unknown NVMe drive {nvme!r}: choose one of {', '.join(NVME_DRIVES)}")
        read = drive[0] if read is None else read
        write = drive[1] if write is None else write
        parts.append(f"{drives} x {nvme}" if drives > 1 else nvme)
    if (read is None) != (write is None):
        raise ValueError("give both the disk's read and write rates (or a named drive)")
    if read is not None and write is not None:
        read, write = read * drives, write * drives
        if nvme is None:
            parts.append(f"disk {read / 1e9:.1f}/{write / 1e9:.1f} GB/s")
    link = PCIE[gen]
    rates = Rates(
        flops=g.bf16_flops,
        efficiency=GPU_EFFICIENCY if efficiency is None else efficiency,
        adam=HOST_ADAM if adam is None else adam,
        disk_read=read,
        disk_write=write,
        pcie=link,
        interconnect=interconnect or g.nvlink or link,
        device_memory=g.memory_bandwidth,
    )
    return replace(rates, source=", ".join(parts))
