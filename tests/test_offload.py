"""Optimizer offload (host memory and NVMe files): the same parameters as without offload, the
state where the ledger says, a pool within host_memory_limit, and clear errors from the disk."""

from __future__ import annotations

import errno
import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch
from support import equivalence
from support.distributed import run_ranks
from support.models import MLP, batch, loss_fn
from support.swap_faults import FaultBackend

import zero_offload as zo
from zero_offload.swap import SwapIOError, SwapSpaceError

STAGES = (1, 2, 3)
DTYPES = ("float32", "bfloat16")
OFFLOADS = ("none", "cpu", "nvme")


def _train_matrix(rank: int, world: int, nvme_root: str) -> dict:
    out = {}
    for stage in STAGES:
        for dtype in DTYPES:
            for off in OFFLOADS:
                engine, _ = equivalence.train(
                    rank,
                    world,
                    "gpt",
                    getattr(torch, dtype),
                    equivalence.STEPS,
                    stage=stage,
                    offload_optimizer=off,
                    nvme_path=nvme_root,
                    sub_group_size=3000,
                )
                rep = engine.memory_report()
                out[(stage, dtype, off)] = (engine.full_state_dict(), rep, engine.shard_numel)
                engine.close()
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as root:
        res = run_ranks(world, _train_matrix, root)
        assert os.listdir(root) == [], "swap files must be removed on close"
        return res


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_is_bit_identical_to_no_offload(world, stage, dtype, offload):
    """On a CPU every tier runs the same Adam kernel: offloading must change no bit."""
    res = results(world)[0]
    base, _, _ = res[(stage, dtype, "none")]
    got, _, _ = res[(stage, dtype, offload)]
    for name in base:
        assert torch.equal(base[name], got[name]), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_ledger_puts_optimizer_state_in_its_tier(world, offload):
    for rank_res in results(world):
        _, rep, s = rank_res[(2, "bfloat16", offload)]
        assert rep.bytes["device"]["optimizer"] == 0
        # bf16 gradient shard on the host: one reduced value per update, no sum to keep
        assert rep.bytes["host"]["grads"] == 2 * s
        if offload == "cpu":
            assert rep.bytes["host"]["optimizer"] == 12 * s
        else:
            assert rep.bytes["nvme"]["optimizer"] == 12 * s
            # host holds only the pool (three sub-group buffers of 12 bytes per param, page
            # rounded) and one sub-group's bf16 output; sub_group_size 3000 rounds down to
            # whole 4 KiB pages of fp32: 2048 params
            group = 2048
            assert rep.bytes["host"]["optimizer"] == 3 * 12 * group + 2 * group


def _run(engine, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = batch("mlp", 4, gen)
        engine.backward(loss_fn("mlp", engine(x), y))
        engine.step()
    return engine.full_state_dict()


def test_small_host_memory_limit_keeps_pool_within_it_and_same_result(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    torch.manual_seed(0)
    ref = _run(zo.initialize(MLP(), stage=2, offload_optimizer="cpu"))
    limit = 8 * 2**20  # room for a few small buffers only; sub-groups shrink to fit
    engine = zo.initialize(
        model,
        stage=2,
        offload_optimizer="nvme",
        nvme_path=tmp_path,
        host_memory_limit=limit,
        sub_group_size=10**9,
    )
    got = _run(engine)
    rep = engine.memory_report()
    assert rep.bytes["host"]["optimizer"] <= limit
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    engine.close()


def test_host_memory_limit_too_small_names_the_fix(tmp_path):
    with pytest.raises(Exception) as err:
        zo.initialize(
            MLP(), stage=2, offload_optimizer="nvme", nvme_path=tmp_path, host_memory_limit=4096
        )
    assert "host_memory_limit" in str(err.value)


def test_unwritable_nvme_path_is_a_clear_error(tmp_path):
    blocked = tmp_path / "file_not_dir"
    blocked.write_text("x")
    with pytest.raises(SwapIOError, match="nvme_path"):
        zo.initialize(MLP(), stage=1, offload_optimizer="nvme", nvme_path=blocked / "sub")


def test_full_disk_is_refused_up_front(tiny_tmpfs):
    big = torch.nn.Linear(512, 512)  # 12 B/param of state: 3 MiB > the 1 MiB disk
    with pytest.raises(SwapSpaceError) as err:
        zo.initialize(big, stage=1, offload_optimizer="nvme", nvme_path=tiny_tmpfs)
    assert str(tiny_tmpfs) in str(err.value)


def test_failed_read_mid_training_raises_and_keeps_the_update_unapplied(tmp_path):
    torch.manual_seed(0)
    engine = zo.initialize(
        MLP(), stage=2, offload_optimizer="nvme", nvme_path=tmp_path, sub_group_size=1024
    )
    _run(engine, steps=1)
    before = engine.full_state_dict()
    engine.swappers[0].engine.backend = FaultBackend("read", errno_=errno.EIO)
    x, y = batch("mlp", 4, torch.Generator().manual_seed(1))
    engine.backward(loss_fn("mlp", engine(x), y))
    with pytest.raises(SwapIOError, match="Input/output error"):
        engine.step()
    engine.swappers[0].engine.backend = FaultBackend("none")
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.optimizer_steps == 1  # rolled back: the step was not counted
    # a retry runs the very update that failed, as if the failure never happened
    engine.zero_grad()
    engine.backward(loss_fn("mlp", engine(x), y))
    assert engine.step()
    torch.manual_seed(0)
    ref = zo.initialize(MLP(), stage=2, offload_optimizer="cpu")
    _run(ref, steps=1)
    ref.backward(loss_fn("mlp", ref(x), y))
    ref.step()
    want, got = ref.full_state_dict(), engine.full_state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    engine.close()


@pytest.mark.parametrize("state", [{}, {"moment_precision": "8bit"}], ids=["fp32", "8bit"])
@pytest.mark.parametrize("op", ["read", "write"])
def test_step_failing_halfway_refuses_to_train_on_until_load_checkpoint(tmp_path, op, state):
    """Two sub-groups; the I/O of the second fails after the first was updated. The state
    is neither the old nor the new one, so nothing may use it until a checkpoint is loaded;
    after that, training continues exactly like an engine that never failed. Both NVMe
    updaters (fp32 AdamW's and any other state policy's) step through one pipeline and fail
    alike."""
    torch.manual_seed(0)
    engine = zo.initialize(
        MLP(),
        stage=2,
        offload_optimizer="nvme",
        nvme_path=tmp_path / "nvme",
        sub_group_size=1024,
        step_during_backward=False,  # the fault counts I/O calls: all of them the step's
        **state,
    )
    _run(engine, steps=1)
    engine.save_checkpoint(tmp_path / "ck")
    swap_io = engine.swappers[0].engine
    swap_io.backend = FaultBackend(op, errno_=errno.EIO, after=1)
    x, y = batch("mlp", 4, torch.Generator().manual_seed(1))
    engine.backward(loss_fn("mlp", engine(x), y))
    with pytest.raises(
        zo.IncompleteStepError, match=r"of 2 NVMe sub-groups.*load_checkpoint"
    ) as err:
        engine.step()
    assert isinstance(err.value.__cause__, SwapIOError)
    swap_io.backend = FaultBackend("none")  # the disk is fine again: still no silent training
    engine.zero_grad()
    engine.backward(loss_fn("mlp", engine(x), y))
    with pytest.raises(zo.IncompleteStepError, match="load_checkpoint"):
        engine.step()
    for read_state in (
        engine.full_state_dict,
        engine.optimizer.state_dict,
        lambda: engine.save_checkpoint(tmp_path / "ck", tag="broken"),
    ):
        with pytest.raises(zo.IncompleteStepError, match="load_checkpoint"):
            read_state()
    assert not (tmp_path / "ck" / "broken").exists()
    engine.load_checkpoint(tmp_path / "ck")
    assert engine.optimizer_steps == 1
    got = _run(engine, steps=2, seed=5)
    torch.manual_seed(0)
    ref = zo.initialize(MLP(), stage=2, offload_optimizer="cpu", **state)
    _run(ref, steps=1)
    want = _run(ref, steps=2, seed=5)
    assert all(torch.equal(want[k], got[k]) for k in want)
    engine.close()
    ref.close()


def test_a_failed_write_back_fails_the_step_at_once_with_its_cause(tmp_path):
    """The first sub-group's write-back fails: the step stops there with the disk's error,
    rather than running the pipeline short of the buffer that write keeps until the pool
    has none left (a wait of ``acquire_timeout``, then a misleading timeout)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(96, 96) for _ in range(3)]
    engine = zo.initialize(
        torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1], torch.nn.Tanh(), layers[2]),
        stage=2,
        offload_optimizer="nvme",
        nvme_path=tmp_path,
        sub_group_size=4096,
        dtype=torch.float32,
        step_during_backward=False,  # the fault counts I/O calls: all of them the step's
    )
    split = engine.optimizer_split
    assert split is not None and split.nvme_numel >= 4 * split.sizing.group
    assert split.sizing.buffers >= 3  # the pipeline reads ahead
    swapper = engine.swappers[0]
    swapper.acquire_timeout = 20.0
    x = torch.randn(8, 96)
    engine.backward(engine(x).square().mean())
    swapper.engine.backend = FaultBackend("write", errno_=errno.EIO, times=1)
    with pytest.raises(zo.IncompleteStepError) as err:
        engine.step()
    assert isinstance(err.value.__cause__, SwapIOError)
    assert "Input/output error" in str(err.value.__cause__)
    engine.close(hand_back=False)


def test_ctrl_c_during_a_step_reaches_the_caller_as_itself(tmp_path, monkeypatch):
    """Ctrl-C after a sub-group was updated: the loop's ``except KeyboardInterrupt`` sees it
    (not a RuntimeError that ``except Exception`` would swallow), and the partly updated
    state is refused until loaded again."""
    from zero_offload.update.nvme.group_step import GroupStep

    step_group, calls = GroupStep.step, [0]

    def interrupted(self, *args, **kwargs):  # SIGINT's handler, firing in sub-group 2
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return step_group(self, *args, **kwargs)

    torch.manual_seed(0)
    engine = zo.initialize(
        MLP(),
        stage=2,
        offload_optimizer="nvme",
        nvme_path=tmp_path,
        sub_group_size=1024,
        step_during_backward=False,  # every sub-group stepped by step()
    )
    x, y = batch("mlp", 4, torch.Generator().manual_seed(1))
    engine.backward(loss_fn("mlp", engine(x), y))
    monkeypatch.setattr(GroupStep, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    with pytest.raises(zo.IncompleteStepError, match="KeyboardInterrupt"):
        engine.full_state_dict()
    engine.close(hand_back=False)


def test_missing_swap_file_is_a_clear_error(tmp_path):
    engine = zo.initialize(MLP(), stage=1, offload_optimizer="nvme", nvme_path=tmp_path)
    for f in Path(engine.swappers[0].rank_dir).iterdir():
        f.unlink()
    x, y = batch("mlp", 4, torch.Generator().manual_seed(1))
    engine.backward(loss_fn("mlp", engine(x), y))
    with pytest.raises(SwapIOError):
        engine.step()
    engine.close()
