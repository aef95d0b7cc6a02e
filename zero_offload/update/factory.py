"""Which updater a run gets: ``offload_optimizer`` and the state policy pick the tier and the
kind (``update.updaters``, ``update.host_state``, ``update.nvme``), and the params decide whether
the master is a second buffer or the fp32 params themselves."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..config import ZeroConfig
from ..device.threads import ThreadBudget
from ..optim import StateLayout
from ..optim.policy import MasterPrecision
from ..swap.pinned import host_empty
from .host_state import HostState, check_device
from .nvme.adam import NvmeAdam
from .nvme.state import NvmeState
from .updater import Updater
from .updaters import DeviceAdam, HostAdam

__all__ = ["make_updater", "params_are_master"]


def params_are_master(cfg: ZeroConfig, dtype: torch.dtype) -> bool:
    """Stage 0 with fp32 compute and the optimizer beside the params: the params, laid out in
    one rank-flat buffer, are the fp32 master (the optimizer steps them in place)."""
    return (
        cfg.sharding.all_reduces
        and dtype == torch.float32
        and not cfg.offload.optimizer_tier.offloaded
        and cfg.optimizer.policy.master is MasterPrecision.FP32
    )


def make_updater(
    numel: int,
    cfg: ZeroConfig,
    device: torch.device,
    dtype: torch.dtype,
    rank: int,
    param_shards: torch.Tensor | None = None,
    host_memory_limit: int | None = None,
    threads: ThreadBudget | None = None,
    device_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    state_layout: StateLayout | None = None,
) -> Updater:
    """Build the updater ``offload_optimizer`` asks for, empty: fill it with ``load_state``.
    ``param_shards``: the rank-flat compute-dtype params when resident (stage 3's shards;
    stage 0's params with fp32 compute, see :func:`params_are_master`); a CPU updater writes
    them in place when they are in host memory, and fp32 ones on the optimizer's device are
    the master itself. ``host_memory_limit``: this updater's share of the host budget (NVMe
    pool). ``threads``: the rank's thread budget (None: decided here for a CPU).
    ``device_optimizer``: what steps a master on an accelerator (None: torch's fused AdamW).
    ``state_layout``: the run's pieces under the state policy (needed by any but fp32 AdamW)."""
    where = cfg.offload.optimizer_tier
    threads = threads or ThreadBudget.decide(device.type, cfg.threads)
    policy = cfg.optimizer.policy
    check_device(cfg, device)
    if where.on_nvme and not policy.is_default:
        assert state_layout is not None and state_layout.numel == numel
        return NvmeState(state_layout, cfg, dtype, rank, host_memory_limit, threads)
    if where.on_nvme:
        return NvmeAdam(numel, cfg, dtype, rank, host_memory_limit, threads)
    out = (
        param_shards
        if param_shards is not None
        and param_shards.device.type == "cpu"
        and param_shards.dtype == dtype
        else None
    )
    # on the host, the master crosses PCIe only as fp32 compute's new params for the device
    crosses = dtype == torch.float32 and out is None
    shared = (
        not where.offloaded
        and param_shards is not None
        and param_shards.dtype == torch.float32
        and param_shards.device == device
    )
    if not policy.is_default:
        assert state_layout is not None and state_layout.numel == numel
        state = HostState(
            state_layout,
            cfg,
            dtype,
            tier=where,  # host or device: NVMe returned above
            out=out,
            num_threads=threads.optimizer,
            master=param_shards[:numel] if shared and param_shards is not None else None,
            crosses_pcie=crosses,
        )
        state.master_is_params = shared and policy.master is MasterPrecision.FP32
        return state
    if shared:
        assert param_shards is not None
        master = param_shards[:numel]  # the fp32 params: no second copy of them
    elif where.on_host:
        master = host_empty(numel, torch.float32, crosses_pcie=crosses)
    else:
        master = torch.empty(numel, dtype=torch.float32, device=device)
    if where.on_host:
        return HostAdam(master, cfg, dtype, out=out, num_threads=threads.optimizer)
    updater: HostAdam | DeviceAdam = (
        HostAdam(master, cfg, dtype, tier="device", out=out, num_threads=threads.optimizer)
        if device.type == "cpu"
        else DeviceAdam(master, cfg, device_optimizer)
    )
    updater.master_is_params = shared
    return updater
