"""One thread budget per rank (``device.threads``): compute, the CPU optimizer kernel, the
kernel beside a backward, and the disk's requests, from the CPUs this process may use and the
ranks of its node; the ``threads`` keyword overrides it; background work on a CPU device runs
at a lower priority than the compute."""

from __future__ import annotations

import os
import re
import threading

import pytest
import torch
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.device import threads as T
from zero_offload.device.threads import ThreadBudget

NODE = dict(affinity=64, machine_cpus=64, physical_cpus=32, torch_threads=32)


def test_ranks_of_a_node_share_its_cores():
    b = ThreadBudget.decide("cuda", local_world_size=8, **NODE)
    assert (b.cores, b.compute, b.optimizer, b.background) == (8, 8, 4, 3)
    assert b.background_nice == 0 and b.io == T.DEFAULT_QUEUE_DEPTH
    alone = ThreadBudget.decide("cuda", local_world_size=1, **NODE)
    assert (alone.cores, alone.compute, alone.optimizer) == (64, 32, 32)  # never raised


def test_a_pinned_rank_keeps_its_cpus():
    """A launcher that gave the process fewer CPUs than the machine has gave them to it."""
    b = ThreadBudget.decide("cuda", local_world_size=8, **{**NODE, "affinity": 16})
    assert (b.cores, b.compute, b.optimizer) == (16, 16, 8)


def test_on_a_cpu_device_background_work_is_one_yielding_thread():
    b = ThreadBudget.decide("cpu", local_world_size=1, **NODE)
    assert (b.background, b.background_nice) == (1, T.BACKGROUND_NICE)


def test_the_keyword_overrides_any_role():
    b = ThreadBudget.decide("cpu", {"optimizer": 3, "io": 2}, local_world_size=8, **NODE)
    assert (b.compute, b.optimizer, b.io) == (8, 3, 2)
    assert ThreadBudget.decide("cpu", 5, **NODE).compute == 5


@pytest.mark.parametrize(
    "value, says",
    [
        ({"gpu": 2}, "unknown role 'gpu'"),
        ({"compute": 0}, "threads['compute']=0"),
        ("many", "expected None, a positive int, or a mapping"),
        (True, "expected None, a positive int, or a mapping"),
    ],
)
def test_bad_threads_are_refused_naming_the_key(value, says):
    with pytest.raises(zo.ConfigError, match=re.escape(says)):
        zo.initialize(TinyGPT(), threads=value)


def test_yield_to_compute_lowers_only_the_calling_thread():
    budget = ThreadBudget.decide("cpu", local_world_size=1, **NODE)
    seen = {}

    def background() -> None:
        T.yield_to_compute(budget)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = threading.Thread(target=background)
    worker.start()
    worker.join()
    assert seen["nice"] == min(19, before + T.BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_engine_runs_its_kernels_on_the_budget(tmp_path, monkeypatch):
    """The step's kernel gets the optimizer threads, the pass during backward the background
    ones, from a thread that yielded first; torch's threads are set from the keyword."""
    import zero_offload.update.nvme.early as early

    yielded = []
    monkeypatch.setattr(early, "yield_to_compute", lambda b: yielded.append(b))
    threads_before = torch.get_num_threads()
    try:
        torch.manual_seed(0)
        engine = zo.initialize(
            TinyGPT(),
            stage=3,
            lr=1e-2,
            offload_optimizer="nvme",
            offload_param="nvme",
            nvme_path=tmp_path,
            threads={"compute": 1, "optimizer": 2, "io": 3},
        )
        assert torch.get_num_threads() == 1
        assert engine.param_store.swapper.engine.queue_depth == 3
        assert engine.threads.optimizer == 2 and engine.threads.background == 1
        assert engine.optimizer.num_threads == 2
        x, y = batch("gpt", 4, torch.Generator().manual_seed(0))
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()
        engine.close()
    finally:
        torch.set_num_threads(threads_before)
    assert yielded == [engine.threads]
