"""Rehearse a run: this rank's ``initialize``, forward, backward and step on a simulated GPU.

The engine's own code runs, down its CUDA paths, with fake tensors (see ``simulate``): every
byte it would put on the GPU is counted by the ``tracker`` as it is allocated and freed, so a
stray full-size copy shows up as it would in ``torch.cuda.max_memory_allocated``. The result
is set beside ``estimate_memory`` for the same configuration (with the measured activations)
in a :class:`~.report.Rehearsal`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import tempfile
import time
import warnings
from concurrent.futures import Executor, Future
from typing import Any, Callable

import torch
import torch.nn as nn

from ..activations.config import DEFAULT_TILE_TOKENS
from ..activations.tiled_loss import tiled_causal_lm_loss
from ..config import ZeroConfig, build_config
from ..engine.engine import Engine
from ..engine.parts import Runtime
from ..planning.estimate.activations import ActivationEstimate, DecoderShape, estimate_activations
from ..planning.estimate.memory import ModelShape, estimate_memory
from ..swap.budget import host_memory_budget
from ..swap.disk import use_disk
from ..update.api import adam_kwargs
from .attention import KERNELS, GpuAttention, describe_kernels, kernel_scratch
from .disk import SimulatedDisk
from .flops import CountFlops
from .models import build_model, causal_lm_batch, prepare_meta_model
from .placement import device_problems
from .report import Rehearsal
from .simulate import DEVICE, SimulatedFusedAdamW, SimulatedStreams, fake_world
from .tracker import ACTIVATIONS, COMM, GATHERED, GRADS, OPTIMIZER, PARAMS, MemoryTracker

__all__ = ["rehearse"]

log = logging.getLogger(__name__)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _identify(holder: dict[str, Engine]) -> Callable[[], dict[int, str]]:
    """What each storage the engine holds is, read from the engine at the moment asked."""

    def identify() -> dict[int, str]:
        engine = holder.get("engine")
        if engine is None:
            return {}
        kinds = {
            "units": PARAMS,
            "gathered": GATHERED,
            "param_shards": PARAMS,
            "param_grads": GRADS,
            "grad_shard": GRADS,
            "optimizer": OPTIMIZER,
            "comm": COMM,
            "activations": ACTIVATIONS,
        }
        out: dict[int, str] = {}
        for kind, tensors in engine.held_tensors().items():
            for tensor in tensors:
                out[_key(tensor)] = kinds[kind]
        return out

    return identify


def _runtime(tracker: MemoryTracker, config: ZeroConfig) -> Runtime:
    """The simulated device's parts: streams whose copies the tracker sees, torch's fused
    AdamW as on CUDA, and the host-side gradient sums in the main thread (fake tensors are
    not thread-safe; the same tensors and sizes)."""
    return Runtime(
        streams=lambda device: SimulatedStreams(device, on_transfer=lambda t: tracker.tag(t, COMM)),
        host_worker=_Inline,
        device_optimizer=lambda params: SimulatedFusedAdamW(params, **adam_kwargs(config)),
    )


class _Inline(Executor):
    """Runs each task at once in the caller's thread: fake tensors are not thread-safe."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as a pool would
            fut.set_exception(exc)
        return fut


def _planned_activations(
    model: nn.Module,
    micro_batch: tuple[int, int] | None,
    checkpointing: bool,
    config: ZeroConfig,
) -> ActivationEstimate | None:
    """The planner's activation figures for this run, when it can compute them: a model of
    a family it knows, a micro-batch of token ids, no offload of every saved tensor."""
    shape = DecoderShape.of(model)
    if shape is None or micro_batch is None or config.activations.mode == "all":
        return None
    return estimate_activations(
        shape,
        batch=micro_batch[0],
        seq=micro_batch[1],
        dtype=config.precision.dtype,
        checkpointing=checkpointing,
        activations=config.activations,
    )


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, torch.Tensor):
        loss = output if output.numel() == 1 else output.float().mean()
    if loss is None:
        raise ValueError("cannot find a loss in the model's output: pass loss_fn")
    return loss


def _forward(
    loss_fn: Callable[[Any], torch.Tensor] | None, engine_kwargs: dict[str, Any]
) -> Callable[[Engine, Any], torch.Tensor]:
    """The loss of one micro-batch: ``loss_fn`` of the model's output; with ``tiled_loss``
    and no ``loss_fn``, a causal LM's tiled loss, run as a forward of the engine (as
    ``ZeroOffloadTrainer`` runs it)."""
    tile = engine_kwargs.get("tiled_loss")
    if loss_fn is None and tile:
        tile_tokens = DEFAULT_TILE_TOKENS if tile is True else int(tile)

        def tiled(engine: Engine, batch: Any) -> torch.Tensor:
            if not isinstance(batch, dict):
                raise ValueError("tiled_loss rehearses a batch of keyword inputs (input_ids=...)")
            return engine.run(
                tiled_causal_lm_loss,
                engine.module,
                tile_tokens=tile_tokens,
                gather=engine.gathered,
                **batch,
            )

        return tiled
    fn = loss_fn or _default_loss
    return lambda engine, batch: fn(_call(engine, batch))


def _call(engine: Engine, batch: Any) -> Any:
    if isinstance(batch, dict):
        return engine(**batch)
    if isinstance(batch, (tuple, list)):
        return engine(*batch)
    return engine(batch)


def rehearse(
    model: nn.Module | str,
    *,
    world_size: int,
    gpu_memory: int,
    micro_batch: tuple[int, int] | None = None,
    batch: Callable[[], Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    checkpointing: bool = False,
    attention: str = "auto",
    iterations: int = 2,
    headroom: float = 0.1,
    host_memory: int | None = None,
    nvme_bytes: int | None = None,
    planner: str = "",
    **engine_kwargs: Any,
) -> Rehearsal:
    """Run rank 0's ``initialize`` and ``iterations`` forward/backward/step rounds of a
    ``world_size``-rank run on a simulated GPU and report the device bytes per phase and
    kind, beside ``estimate_memory``'s and the GPU size (``gpu_memory`` bytes, of which
    ``headroom`` is kept free for the CUDA context and the allocator's slack).

    ``model``: a module on the meta device (used up: the engine takes its parameters), or a
    built-in name (``llama-7b``, ``llama-13b``, ``llama-70b``) or Hugging Face config folder.
    ``micro_batch``: (sequences, tokens) of one rank's micro-batch, for a causal LM; or give
    ``batch``, a function returning the model's inputs (called under fake tensors: their
    shapes matter, not values) and ``loss_fn`` (output -> scalar loss; default ``.loss`` or
    the output's mean; with ``tiled_loss`` and no ``loss_fn``, the tiled loss of a Hugging
    Face causal LM, as ``ZeroOffloadTrainer`` computes it). ``checkpointing``: a named model
    recomputes its layers in backward.
    ``attention``: how ``scaled_dot_product_attention`` is counted: ``"auto"``, the kernel a
    GPU picks for those inputs (flash / memory-efficient: no s² scores); ``"math"``, the
    math path; ``"flash"`` / ``"efficient"`` force one; ``"eager"`` builds a named model
    with its eager attention code (see ``rehearsal.attention``).
    ``host_memory`` (bytes per node): the target node's host memory, from which each rank's
    default ``host_memory_limit`` is taken as on that node (it sizes the NVMe pipeline), and
    the planner's advice. Other keywords go to ``initialize`` (stage, offload_optimizer,
    offload_param, dtype, prefetch_depth, ...). The NVMe tier (``"nvme"``) is simulated: the
    swap files keep their sizes, not their bytes, on a disk of ``nvme_bytes`` for this rank
    (default: unlimited); ``nvme_path`` need not exist on this machine. ``planner``: the
    planner's explanation of the configuration, shown in the report.
    """
    if attention not in KERNELS:
        raise ValueError(f"attention={attention!r}: expected one of {', '.join(KERNELS)}")
    name = model if isinstance(model, str) else type(model).__name__
    if isinstance(model, str):
        model = build_model(model, checkpointing=checkpointing, attention=attention)
    if batch is None:
        if micro_batch is None:
            raise ValueError("give micro_batch=(sequences, tokens) or a batch function")
        b, s = micro_batch
        batch = lambda: causal_lm_batch(b, s)  # noqa: E731
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    sim_kwargs = dict(engine_kwargs)
    if host_memory is not None and "host_memory_limit" not in sim_kwargs:
        # as on the target node: its memory shared by its ranks (estimate_memory's rule)
        sim_kwargs["host_memory_limit"] = host_memory_budget(
            None, available=int(host_memory), ranks=min(world_size, 8)
        )
    disk = None
    stack = contextlib.ExitStack()
    if "nvme" in (engine_kwargs.get("offload_optimizer"), engine_kwargs.get("offload_param")):
        disk = SimulatedDisk(nvme_bytes)
        # the swap folder is real and stays empty: the files are the simulated disk's
        sim_kwargs["nvme_path"] = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="zero-offload-rehearsal-")
        )
        stack.enter_context(use_disk(disk))
    with stack:
        result = _rehearse(
            model,
            name,
            world_size=world_size,
            gpu_memory=gpu_memory,
            micro_batch=micro_batch,
            batch=batch,
            forward=_forward(loss_fn, sim_kwargs),
            checkpointing=checkpointing,
            attention=attention,
            iterations=iterations,
            headroom=headroom,
            host_memory=host_memory,
            disk=disk,
            engine_kwargs=engine_kwargs,
            config=build_config(None, device=DEVICE, **sim_kwargs),
        )
    return dataclasses.replace(result, planner=planner) if planner else result


def _rehearse(
    model: nn.Module,
    name: str,
    *,
    world_size: int,
    gpu_memory: int,
    micro_batch: tuple[int, int] | None,
    batch: Callable[[], Any],
    forward: Callable[[Engine, Any], torch.Tensor],
    checkpointing: bool,
    attention: str,
    iterations: int,
    headroom: float,
    host_memory: int | None,
    disk: SimulatedDisk | None,
    engine_kwargs: dict[str, Any],
    config: ZeroConfig,
) -> Rehearsal:
    shape = ModelShape.of(model)
    holder: dict[str, Engine] = {}
    tracker = MemoryTracker(DEVICE.type, _identify(holder), disk=disk, scratch=kernel_scratch)
    kernels = GpuAttention(attention)
    problems: list[str] = []
    failure: str | None = None
    start = time.perf_counter()
    with fake_world(world_size), warnings.catch_warnings():
        # the engine compares storages by data_ptr(), which fake tensors answer with 0
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        prepare_meta_model(model)
        with kernels, tracker:
            try:
                tracker.begin("initialize")
                engine = Engine(model, config, runtime=_runtime(tracker, config))
                tracker.end()
                holder["engine"] = engine
                problems += device_problems(engine, "after initialize")
                for _ in range(iterations):
                    inputs = batch()
                    tracker.begin("forward")
                    with CountFlops() as flops:
                        loss = forward(engine, inputs)
                    tracker.add_flops(flops.total)
                    tracker.end()
                    tracker.begin("backward")
                    with CountFlops() as flops:
                        engine.backward(loss)
                    tracker.add_flops(flops.total)
                    del loss
                    tracker.end()
                    tracker.begin("step")
                    engine.step()
                    # the whole update counts as the step: with overlap_step its tail would
                    # run under the next forward, on the host and the disk (no device bytes)
                    engine.finish_step()
                    tracker.end()
                problems += device_problems(engine, "after the last step")
                engine.close(hand_back=False)  # nothing to hand back: no values
            except Exception as exc:
                tracker.end()
                failure = f"{tracker.phase}: {type(exc).__name__}: {exc}"
                log.warning("rehearsal failed", exc_info=True)
                if "Mismatch" in type(exc).__name__:
                    problems.append(
                        f"{tracker.phase}: an operation mixed host and device tensors ({exc})"
                    )
    wall = time.perf_counter() - start
    measured = dict(tracker.phases)
    acts = max(
        (
            measured[p].device_kinds.get("activations", 0)
            for p in ("forward", "backward")
            if p in measured
        ),
        default=0,
    )
    est_kwargs: dict[str, Any] = dict(
        num_gpus=world_size,
        stage=config.stage,
        offload_optimizer=config.offload.optimizer,
        offload_param=config.offload.param,
        dtype=config.precision.dtype,
        optimizer_type=config.optimizer.optimizer_type,
        moment_precision=config.optimizer.moment_precision,
        master_precision=config.optimizer.master_precision,
        fp32_moment_params=config.optimizer.fp32_moment_params,
        prefetch_depth=config.prefetch_depth,
        reduce_bucket_size=config.reduce_bucket_size,
        sub_group_size=config.offload.sub_group_size,
        offload_optimizer_fraction=config.offload.optimizer_fraction,
        host_memory_limit=config.offload.host_memory_limit,
        host_available=host_memory,
        # a rehearsal's fake gradients have no values to step during backward: its disk is
        # compared with the estimate of a run without that pass (estimate_memory counts it)
        step_during_backward=False,
    )
    estimate = estimate_memory(shape, activation_bytes=acts or None, **est_kwargs)
    planned = _planned_activations(model, micro_batch, checkpointing, config)
    planned_estimate = (
        estimate_memory(shape, activations=planned, **est_kwargs) if planned is not None else None
    )
    return Rehearsal(
        model=name,
        num_params=shape.num_params,
        world_size=world_size,
        gpu_memory=int(gpu_memory),
        headroom=headroom,
        host_memory=host_memory,
        engine_kwargs={k: v for k, v in engine_kwargs.items()},
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        attention=describe_kernels(attention, dict(kernels.calls)),
        attention_calls=dict(kernels.calls),
        phases=measured,
        activation_bytes=acts,
        planned_activations=planned,
        planned_estimate=planned_estimate,
        estimate=estimate,
        shape=shape,
        estimate_kwargs=est_kwargs,
        problems=tuple(problems),
        failure=failure,
        wall_s=wall,
        nvme_simulated=disk is not None,
        max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
