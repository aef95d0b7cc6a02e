"""The CUDA path: the engine on a GPU trains to the CPU reference (stages 1-3, offload none / cpu /
nvme, one process and two NCCL ranks), host buffers are page-locked, swaps to and from CUDA
tensors round-trip, ``engine.step()`` (offload none) and forward/backward (offload none or to
host memory) issue no synchronizing CUDA call, and delayed side streams still give the
reference result (every cross-stream hand-over waits for its event).

Everything here skips without CUDA; ``tests/gpu/check.sh`` runs it on a machine with a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support import equivalence
from support.models import batch, loss_fn, make

import zero_offload as zo
from zero_offload.swap import HostBuffer, Swapper, Tier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (stage, offload_optimizer, offload_param)
CASES = [(s, o, "none") for s in (1, 2, 3) for o in ("none", "cpu", "nvme")] + [
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
]
# GPU and CPU fp32 kernels reduce in different orders: gradients differ in the last bits, which
# Adam's g / sqrt(v) can amplify where a gradient is near zero. Tighter than one Adam step.
MAX_DIFF_LR, MEAN_DIFF = 0.5, 1e-5


@pytest.fixture(autouse=True)
def _exact_fp32():
    """No TF32: the reference is fp32 on the CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _train(
    rank: int,
    world: int,
    nvme: str,
    stage: int,
    opt: str,
    param: str,
    steps: int = equivalence.STEPS,
) -> tuple[zo.Engine, torch.nn.Module]:
    """equivalence.train on the GPU: targets go to the engine's device too."""
    torch.manual_seed(0)
    model = make("gpt")
    initial = copy.deepcopy(model)
    engine = zo.initialize(
        model,
        lr=equivalence.LR,
        weight_decay=equivalence.WD,
        max_grad_norm=equivalence.CLIP,
        dtype=torch.float32,
        stage=stage,
        offload_optimizer=opt,
        offload_param=param,
        nvme_path=nvme,
        sub_group_size=3000,
    )
    gen = torch.Generator().manual_seed(1234)
    per_rank = equivalence.GLOBAL_BATCH // world
    for _ in range(steps):
        x, y = batch("gpt", equivalence.GLOBAL_BATCH, gen)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        engine.backward(loss_fn("gpt", engine(x[sl]), y[sl].to(engine.device)))
        engine.step()
    return engine, initial


def _case(rank: int, world: int, nvme: str, stage: int, opt: str, param: str) -> dict:
    engine, initial = _train(rank, world, nvme, stage, opt, param)
    assert engine.device.type == "cuda"
    info = {
        "grads_pinned": (engine.grads.is_pinned() if engine.grads is not None else False)
        if opt != "none"
        else None
    }
    sd = engine.full_state_dict()
    engine.close()
    if rank == 0:
        ref = equivalence.reference(initial, "gpt", torch.float32, equivalence.STEPS)
        info["max_diff_lr"], info["mean_diff"] = equivalence.compare(sd, ref)
    return info


def _check(info: dict, opt: str) -> None:
    assert info["max_diff_lr"] <= MAX_DIFF_LR, f"max |diff| = {info['max_diff_lr']:.4f} lr"
    assert info["mean_diff"] <= MEAN_DIFF
    if opt != "none":  # summed on the host from pinned staging buffers: never crosses PCIe
        assert info["grads_pinned"] is False, "the fp32 host gradients are pinned for nothing"


@pytest.mark.parametrize("stage,opt,param", CASES)
def test_engine_on_cuda_matches_cpu_reference(
    tmp_path: Path, stage: int, opt: str, param: str
) -> None:
    _check(_case(0, 1, str(tmp_path), stage, opt, param), opt)


def _nccl_entry(
    rank: int,
    world: int,
    init_file: str,
    out_dir: str,
    nvme: str,
    cases: list,
    env: dict | None = None,
) -> None:
    os.environ.update(env or {})
    os.environ["LOCAL_RANK"] = str(rank)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = {case: _case(rank, world, nvme, *case) for case in cases}
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL"
)
def test_two_nccl_ranks_match_cpu_reference(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _nccl_entry,
            args=(2, os.path.join(tmp, "init"), tmp, str(tmp_path), CASES),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        with open(os.path.join(tmp, "rank0.pkl"), "rb") as f:
            results = pickle.load(f)
    for (_stage, opt, _param), info in results.items():
        _check(info, opt)


@pytest.mark.multiprocess
@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL"
)
def test_two_nccl_ranks_without_record_streams(tmp_path: Path) -> None:
    """``TORCH_NCCL_AVOID_RECORD_STREAMS=1``: NCCL stops protecting the collectives' inputs
    with ``record_stream``, so only the engine's own hand-overs keep the gathers' shards and
    the reduced gradients alive while a side stream reads them."""
    cases = [(2, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"), (3, "none", "none")]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _nccl_entry,
            args=(
                2,
                os.path.join(tmp, "init"),
                tmp,
                str(tmp_path),
                cases,
                {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"},
            ),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        with open(os.path.join(tmp, "rank0.pkl"), "rb") as f:
            results = pickle.load(f)
    for (_stage, opt, _param), info in results.items():
        _check(info, opt)


def test_host_buffer_is_pinned() -> None:
    buf = HostBuffer(4 << 20, pin=True)
    try:
        assert buf.pinned and buf.tensor.is_pinned()
        dev = torch.empty(buf.nbytes, dtype=torch.uint8, device="cuda")
        buf.tensor.fill_(7)
        dev.copy_(buf.tensor, non_blocking=True)  # DMA from page-locked memory
        torch.cuda.synchronize()
        assert int(dev[-1]) == 7
    finally:
        buf.close()
    plain = HostBuffer(4096, pin=False)
    assert not plain.pinned and not plain.tensor.is_pinned()
    plain.close()


@pytest.mark.parametrize("dtype,numel", [(torch.float32, 1 << 20), (torch.bfloat16, 1000)])
def test_swap_round_trip_through_cuda(tmp_path: Path, dtype: torch.dtype, numel: int) -> None:
    with Swapper(tmp_path, buffer_bytes=8 << 20, buffer_count=2) as sw:
        buf = sw.pool.acquire()
        assert buf.pinned and buf.tensor.is_pinned(), "pool buffers are pinned under CUDA"
        sw.pool.release(buf)
        src = torch.randn(numel, device="cuda").to(dtype)
        sw.swap_out("k", src).result()
        assert sw.where("k") is Tier.NVME
        out = torch.empty_like(src)
        assert sw.swap_in("k", out=out).result() is out
        torch.cuda.synchronize()
        assert torch.equal(out, src)
        assert sw.where("k") is Tier.DEVICE
        sw.release("k")
        assert sw.where("k") is Tier.NVME


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_synchronizes_once(stage: int, dtype: torch.dtype) -> None:
    """``set_sync_debug_mode("warn")`` warns on each synchronizing CUDA call; ``step()`` with
    offload none makes one: reading the ranks' agreed gradient flags (and norm)."""
    torch.manual_seed(0)
    engine = zo.initialize(make("gpt"), stage=stage, dtype=dtype, lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def micro_step() -> None:
        x, y = batch("gpt", 4, gen)
        engine.backward(loss_fn("gpt", engine(x), y.to(engine.device)))

    micro_step()
    engine.step()  # first step: lazily created optimizer state, recorded module order
    torch.cuda.synchronize()
    syncs: list[str] = []
    for _ in range(2):
        micro_step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs += [
            f"{w.filename}:{w.lineno}: {w.message}"
            for w in caught
            if "synchroniz" in str(w.message)
        ]
    engine.close()
    assert len(syncs) == 2, "engine.step() should synchronize once per step:\n" + "\n".join(syncs)


# (stage, offload_optimizer, offload_param) whose forward and backward should not synchronize
NO_SYNC_CASES = [
    (2, "none", "none"),
    (2, "cpu", "none"),
    (3, "none", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
]


@pytest.mark.parametrize("stage,opt,param", NO_SYNC_CASES)
def test_forward_backward_do_not_synchronize(stage: int, opt: str, param: str) -> None:
    """Gathers ahead (host-to-device copy, all-gather on the gather stream) and reduced
    gradients going to the host (device-to-host stream, summed by a worker thread) make the
    host wait for nothing in forward and backward: the compute stream never stalls for them."""
    torch.manual_seed(0)
    engine = zo.initialize(
        make("gpt"),
        stage=stage,
        dtype=torch.bfloat16,
        lr=1e-3,
        offload_optimizer=opt,
        offload_param=param,
        prefetch_depth=2,
    )
    gen = torch.Generator().manual_seed(0)
    syncs: list[str] = []
    for step in range(3):
        x, y = batch("gpt", 4, gen)
        x, y = x.to(engine.device), y.to(engine.device)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.backward(loss_fn("gpt", engine(x), y))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if step > 0:  # the first forward records the module order
            syncs += [
                f"{w.filename}:{w.lineno}: {w.message}"
                for w in caught
                if "synchroniz" in str(w.message)
            ]
        engine.step()
    engine.close()
    assert not syncs, "forward/backward synchronized:\n" + "\n".join(syncs)


LATE_CASES = [(3, "cpu", "cpu"), (3, "nvme", "none")] + (
    [] if os.environ.get("TORCH_CUDA_SANITIZER") else [(2, "cpu", "none"), (3, "nvme", "nvme")]
)


@pytest.mark.parametrize("when", ["before", "after"])
def test_side_streams_are_ordered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Every side stream runs late: a long sleep queued before each of its copies and
    gathers (a missing event wait reads unfilled parameters or stale gradients), or after
    each of its reads (a missing ``record_stream`` or a host buffer reused too early lets the
    memory be overwritten while the side stream still reads it). The compute stream is slow
    before each gradient copy too. Training must still match the reference."""
    from zero_offload.device import streams as streams_mod

    cycles = 20_000_000  # ~10 ms
    S = streams_mod.Streams
    original = (S.to_device, S.to_host, S.on_gather, S.copy_into)

    def sleep_on(stream) -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)

    def late_to_device(self, host, dtype=None, *, own=False):
        if when == "before":
            sleep_on(self.h2d)
        out = original[0](self, host, dtype, own=own)
        if when == "after":
            sleep_on(self.h2d)
        return out

    def late_copy_into(self, target, values):
        if when == "before":
            sleep_on(self.h2d)
        out = original[3](self, target, values)
        if when == "after":
            sleep_on(self.h2d)
        return out

    def late_to_host(self, values, out):
        torch.cuda._sleep(cycles)  # the producer (compute stream) is slow too
        if when == "before":
            sleep_on(self.d2h)
        event = original[1](self, values, out)
        if when == "after":
            sleep_on(self.d2h)
        return event

    @contextlib.contextmanager
    def late_on_gather(self, after):
        with original[2](self, after):
            if when == "before":
                torch.cuda._sleep(cycles)
            yield
            if when == "after":
                torch.cuda._sleep(cycles)

    monkeypatch.setattr(S, "to_device", late_to_device)
    monkeypatch.setattr(S, "copy_into", late_copy_into)
    monkeypatch.setattr(S, "to_host", late_to_host)
    monkeypatch.setattr(S, "on_gather", late_on_gather)
    for stage, opt, param in LATE_CASES:
        _check(_case(0, 1, str(tmp_path), stage, opt, param), opt)


@pytest.mark.skipif(bool(os.environ.get("TORCH_CUDA_SANITIZER")), reason="already sanitized")
def test_stream_tests_pass_the_cuda_sanitizer(tmp_path: Path) -> None:
    """The late-stream tests again under ``TORCH_CUDA_SANITIZER=1`` (CSAN), which fails on
    any kernel that reads or writes memory another stream touches without a wait between."""
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_side_streams_are_ordered",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, tail
    assert "data race" not in tail.lower(), tail


@pytest.mark.parametrize(
    "stage,opt,param", [(2, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme")]
)
def test_frozen_parameters_on_cuda_match_the_cpu_engine(
    tmp_path: Path, stage: int, opt: str, param: str
) -> None:
    """Frozen units on CUDA: no optimizer state, values exported through the side streams
    (``Engine.frozen_shard``), the rest trained like the CPU engine."""

    def run(device: str) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
        model[0].requires_grad_(False)
        model[2].weight.requires_grad_(False)
        engine = zo.initialize(
            model,
            stage=stage,
            offload_optimizer=opt,
            offload_param=param,
            nvme_path=tmp_path,
            dtype=torch.float32,
            lr=1e-2,
            weight_decay=0.1,
            device=device,
        )
        for i in range(3):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).to(device)
            engine.backward(engine(x).square().mean())
            engine.step()
        sd = engine.full_state_dict()
        engine.close()
        return sd

    torch.manual_seed(0)
    initial = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4))).state_dict()
    on_gpu, on_cpu = run("cuda"), run("cpu")
    for name in ("0.weight", "0.bias", "2.weight"):
        assert torch.equal(on_gpu[name], initial[name]), name
    for name, value in on_cpu.items():
        assert (on_gpu[name] - value).abs().max().item() <= MAX_DIFF_LR * 1e-2, name
