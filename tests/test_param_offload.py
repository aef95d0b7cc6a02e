"""Stage-3 parameter shards on the host and on NVMe, with asynchronous prefetch: the same
parameters as stage 3 without offload, budgets kept, and a model built on the meta device
materialized unit by unit. (A changed module order with params on NVMe: test_engine.)"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
import torch.nn as nn
from support import equivalence
from support.distributed import run_ranks
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.params.sizing import WRITE_BACK_BUFFERS
from zero_offload.swap.swapper import Tier

PARAMS = ("cpu", "nvme")
OPTIMIZERS = ("none", "cpu", "nvme")
DEPTHS = (0, 1, 3)


def _matrix(rank: int, world: int, root: str) -> dict:
    out = {}
    configs = [("none", "none", 2)] + [
        (p, o, d) for p in PARAMS for o in OPTIMIZERS for d in DEPTHS
    ]
    for param, optim, depth in configs:
        engine, _ = equivalence.train(
            rank,
            world,
            "gpt",
            torch.bfloat16,
            4,
            stage=3,
            offload_param=param,
            offload_optimizer=optim,
            prefetch_depth=depth,
            nvme_path=root,
            sub_group_size=3000,
        )
        out[(param, optim, depth)] = (
            engine.full_state_dict(),
            engine.memory_report(),
            max(u.full_bytes for u in engine.units),
        )
        engine.close()
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as root:
        res = run_ranks(world, _matrix, root)
        assert os.listdir(root) == [], "swap files must be removed on close"
        return res


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("param", PARAMS)
def test_param_offload_trains_like_stage3_without_offload(world, param, optim, depth):
    res = results(world)[0]
    base = res[("none", "none", 2)][0]
    got = res[(param, optim, depth)][0]
    for name in base:  # the same kernels run on every tier: equal bit for bit
        assert torch.equal(base[name], got[name]), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("param", PARAMS)
def test_ledger_shows_param_tier_and_gather_budget(world, param):
    for rank_res in results(world):
        for depth in DEPTHS:
            # (with the optimizer on NVMe too, no whole-shard staging buffer is needed)
            _, rep, largest = rank_res[(param, "nvme", depth)]
            tier = "host" if param == "cpu" else "nvme"
            assert rep.bytes[tier]["params"] > 0
            # nothing gathered after the step; the device holds no parameter shard
            assert rep.bytes["device"]["params"] == 0
            # besides the running unit and the tied embedding, `depth` units are all-gathered
            # ahead from host memory; from NVMe one less (the last one is only read ahead)
            ahead = max(depth - 1, 0) if param == "nvme" else depth
            assert rep.peak_gathered_param_bytes <= (ahead + 2) * largest


def test_host_memory_limit_bounds_both_pools(tmp_path):
    limit = 16 * 2**20
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(),
        stage=3,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=tmp_path,
        host_memory_limit=limit,
        dtype=torch.bfloat16,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = batch("gpt", 4, gen)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
    pools = sum(s.host_buffer_nbytes for s in engine.swappers)
    assert pools <= limit
    engine.close()


def test_meta_device_model_is_materialized_unit_by_unit(tmp_path):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT()
    assert all(p.is_meta for p in model.parameters())
    engine = zo.initialize(
        model, stage=3, lr=1e-2, offload_param="nvme", offload_optimizer="nvme", nvme_path=tmp_path
    )
    start = engine.full_state_dict()
    assert not any(p.is_meta for p in engine.module.parameters())
    assert engine.module.lm_head.weight is engine.module.wte.weight  # the tie survives
    assert all(
        torch.isfinite(v).all() and v.abs().sum() > 0
        for k, v in start.items()
        if not k.endswith("bias")
    )
    # from here it trains exactly like the same weights built on the CPU
    ref_model = TinyGPT()
    ref_model.load_state_dict(start)
    ref = zo.initialize(ref_model, stage=3, lr=1e-2)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(3):
        for eng, gen in ((engine, gen_a), (ref, gen_b)):
            x, y = batch("gpt", 4, gen)
            eng.backward(loss_fn("gpt", eng(x), y))
            eng.step()
    got, want = engine.full_state_dict(), ref.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    engine.close()


def test_meta_module_without_reset_parameters_is_a_clear_error():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return x @ self.w

    with torch.device("meta"):
        model = Bare()
    with pytest.raises(ValueError, match="reset_parameters"):
        zo.initialize(model, stage=3)


def test_param_pool_smaller_than_prefetch_depth_degrades_not_deadlocks(tmp_path):
    """A budget that holds two shard buffers while prefetch_depth asks for five: reads ahead
    are skipped when no spare buffer is free, never waited for, and results are unchanged."""

    def run(**kw):
        torch.manual_seed(0)
        engine = zo.initialize(
            TinyGPT(),
            stage=3,
            lr=1e-2,
            offload_param="nvme",
            offload_optimizer="cpu",
            nvme_path=tmp_path,
            prefetch_depth=3,
            **kw,
        )
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            x, y = batch("gpt", 4, gen)
            engine.backward(loss_fn("gpt", engine(x), y))
            engine.step()
        sd, pool = engine.full_state_dict(), engine.param_store.swapper.pool.count
        engine.close()
        return sd, pool

    tight, count = run(host_memory_limit=2 * 20480)  # two buffers of the largest shard
    assert count == 2
    roomy, _ = run()
    assert all(torch.equal(tight[k], roomy[k]) for k in roomy)
    single, count = run(host_memory_limit=20480)  # gathers hold no buffer a read waits for
    assert count == 1
    assert all(torch.equal(single[k], roomy[k]) for k in roomy)


def test_cpu_device_gathers_from_the_buffer_the_nvme_read_filled(tmp_path):
    """On a CPU device the shard read from NVMe is already where the all-gather reads it: it
    is lent from the pool buffer (a copy of it cost a fresh allocation and its page faults
    for every unit, twice a step) and the buffer goes back once the all-gather is done."""
    engine = zo.initialize(
        TinyGPT(),
        stage=3,
        lr=1e-2,
        offload_param="nvme",
        offload_optimizer="cpu",
        nvme_path=tmp_path,
    )
    store = engine.param_store
    unit = next(u for u in engine.units if u.sharded_params)
    key, free = store._key(unit), store.swapper.pool.available
    shard, copied, give_back, _ = store.lend(unit)
    assert copied is None and give_back is not None
    assert store.swapper.where(key) is Tier.HOST and store.swapper.pool.available == free - 1
    expected = shard.clone()
    give_back()
    assert store.swapper.where(key) is Tier.NVME and store.swapper.pool.available == free
    own, _ = store.load(unit)  # a tensor of the caller's own, the buffer back at once
    assert torch.equal(own, expected) and store.swapper.pool.available == free
    x, y = batch("gpt", 4, torch.Generator().manual_seed(0))
    engine.backward(loss_fn("gpt", engine(x), y))
    engine.step()
    assert store.swapper.pool.available == store.swapper.pool.count - len(store._prefetched)
    engine.close()


def test_one_rank_backward_reads_every_unit_ahead(tmp_path):
    """One rank of a CPU device: each unit the backward gathers was read from NVMe ahead, as
    in the forward. A gather ahead there takes the shard's memory at once, so it used to wait
    for its read on the spot, hold a pool buffer the next read ahead needed, and leave its
    unit gathered, which the backward took for not needing to look ahead: 37 of the 38
    gathers of a backward over 6 layers started their own read."""
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(layers=6, width=128), stage=3, lr=1e-2, offload_param="nvme", nvme_path=tmp_path
    )
    store = engine.param_store
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x, y = batch("gpt", 4, gen)
        store.unread_ahead = 0
        loss = loss_fn("gpt", engine(x), y)
        in_forward = store.unread_ahead
        store.unread_ahead = 0
        engine.backward(loss)
        # the backward's first unit (the tied embedding the loss' head used last) has
        # nothing before it to be read ahead with
        if step > 0:  # the first forward has no recorded order to read ahead from
            assert (in_forward, store.unread_ahead) == (0, 1), (step, in_forward)
        engine.step()
    engine.close()


def test_forward_reads_ahead_beside_an_update_that_writes_parameters_back(tmp_path):
    """Optimizer and parameters on NVMe with the update beside the passes (the defaults):
    the update's new shards stay in pool buffers as their units' reads ahead. With a pool of
    only ``prefetch_depth + 2`` buffers one was left free and the forward started no reads
    ahead (at 1.02B, 78 of 124 forward gathers waited on the disk each step)."""
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(layers=6, width=128),
        stage=3,
        lr=1e-2,
        offload_optimizer="nvme",
        offload_param="nvme",
        nvme_path=tmp_path,
        sub_group_size=20_000,
    )
    store = engine.param_store
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        x, y = batch("gpt", 4, gen)
        store.unread_ahead = 0
        loss = loss_fn("gpt", engine(x), y)
        if step > 0:  # the first forward has no recorded order to read ahead from
            assert store.unread_ahead == 0, (step, store.unread_ahead)
        engine.backward(loss)
        engine.step()
    engine.close()


def _full_pool(tmp_path):
    """An engine after one step whose NVMe parameter pool has four buffers, three of them
    reads ahead of the first units in files and one lent for a write to come; the units."""
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(layers=6, width=128),
        stage=3,
        lr=1e-2,
        offload_optimizer="cpu",  # a pool of prefetch_depth + 2 = 4 buffers
        offload_param="nvme",
        nvme_path=tmp_path,
    )
    store = engine.param_store
    x, y = batch("gpt", 4, torch.Generator().manual_seed(0))
    engine.backward(loss_fn("gpt", engine(x), y))
    engine.step()
    store.drop_prefetched()
    store.unread_ahead = 0
    pool = store.swapper.pool
    units = [u for u in engine.units if u.shard_numel and store.view(u) is None]
    assert pool.count == 4 and len(units) >= 5
    for u in units[:3]:  # a read ahead starts while two buffers are free: three of four
        store.prefetch(u)
    assert list(store._prefetched) == [u.index for u in units[:3]] and pool.available == 1
    store.target(units[3])  # the last free buffer, for a write to come
    assert pool.available == 0
    return engine, units


def test_a_buffer_needed_now_takes_only_the_read_ahead_needed_last(tmp_path):
    """With every pool buffer taken, a read or write that cannot wait gets one buffer: the
    read ahead started last (the one its pass needs last) goes, the others stay. Giving
    back every read ahead made the next gathers read again from the disk what the update
    had just left in the buffers (the update under the forward at 99M: 20 of a forward's
    gathers waited on the disk, 0.7 s a step; 0 and 0.03 s once only one goes)."""
    engine, units = _full_pool(tmp_path)
    store = engine.param_store
    lent = store.lend(units[4])  # needed now: the read ahead of units[2] makes room
    assert list(store._prefetched) == [u.index for u in units[:2]]
    assert store.unread_ahead == 1
    if lent.give_back is not None:
        lent.give_back()
    store.give_back()
    engine.close()


def test_a_write_takes_the_buffer_of_its_own_stale_read_ahead_first(tmp_path):
    """A unit about to be written whose old shard was read ahead gives that buffer up
    before any other read ahead: the write makes it stale, while the others are the next
    gathers' shards. A target and a copying put each need a buffer with none free."""
    engine, units = _full_pool(tmp_path)
    store = engine.param_store
    target = store.target(units[1])  # units[1]'s read ahead goes, not units[2]'s
    assert list(store._prefetched) == [units[0].index, units[2].index]
    store.put(units[1], target)  # its new values stay as its read ahead
    assert list(store._prefetched) == [units[0].index, units[2].index, units[1].index]
    store.put(units[2], torch.zeros_like(target[: units[2].shard_numel]))  # a copying put
    assert list(store._prefetched) == [units[0].index, units[1].index]
    store.flush()
    store.give_back()
    engine.close()


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_param_pool_holds_write_back_buffers_only_for_an_nvme_update(tmp_path, optimizer):
    """Only the NVMe optimizer's update writes new shards back beside the passes; with the
    optimizer in host memory the pool's buffers for those write-backs would sit idle (4 ×
    the largest shard: 650 MB a rank at 13B on 4 ranks). With it on NVMe, one buffer per
    unit a sub-group's step puts at once (at least 4): counted here from the optimizer's
    own sub-groups and the units. The estimate counts what the engine allocates."""
    engine = zo.initialize(
        TinyGPT(layers=4, width=64),
        stage=3,
        offload_optimizer=optimizer,
        offload_param="nvme",
        nvme_path=tmp_path,
        prefetch_depth=2,
    )
    try:
        pool = engine.param_store.swapper.pool
        write_backs = 0
        if optimizer == "nvme":
            ends = [(u.shard_offset, u.shard_offset + u.shard_numel) for u in engine.units]
            split = engine.optimizer_split  # the optimizer's sub-groups, from the shard's start
            group = split.sizing.group
            per_group = [
                sum(1 for a, b in ends if b > lo and a < lo + group and b > a)
                for lo in range(0, split.numel, group)
            ]
            write_backs = max(WRITE_BACK_BUFFERS, *per_group)
            assert max(per_group) > WRITE_BACK_BUFFERS  # the case the rule is for
        assert pool.count == 2 + 2 + write_backs
    finally:
        engine.close()


def test_an_update_under_the_forward_puts_a_sub_groups_units_without_waiting(tmp_path):
    """A sub-group's step under the forward puts the new shards of every unit it covers
    at once. With 4 write-back buffers for a block of 10 units (99M) each put took the
    buffer of a read ahead the forward was about to gather and waited for its write:
    0.3 s of a 1.3 s forward. Now no read ahead is given up for room, and every gather
    was read ahead but each step's first (with 4 buffers here: 4 given up, 7 unread)."""
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(layers=8, width=64),
        stage=3,
        lr=1e-2,
        offload_optimizer="nvme",
        offload_param="nvme",
        nvme_path=tmp_path,
        overlap_step=True,
        step_during_backward=False,
    )
    store = engine.param_store
    gen = torch.Generator().manual_seed(0)
    try:
        for step in range(3):
            x, y = batch("gpt", 4, gen)
            if step == 1:  # from the first update under the forward on
                store.given_up_ahead = store.unread_ahead = 0
            engine.backward(loss_fn("gpt", engine(x), y))
            engine.step()
        assert store.given_up_ahead == 0
        assert store.unread_ahead <= 2  # one a step (its first gather starts cold)
    finally:
        engine.close()
