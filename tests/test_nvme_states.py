"""The NVMe optimizer carries every optimizer kind and state precision: 8-bit AdamW and fp32
Lion with the state in files train to the bits of the same run with the state in host memory
(every CPU tier runs the same kernel on the same elements), with ``step_during_backward`` /
``overlap_step`` on and off, a share of the sub-groups in host memory, and sub-groups cut on
8-bit block boundaries; a checkpoint saved on NVMe resumes bit for bit; the disk moves what
the policy keeps, so 8-bit moments move at most 0.55x fp32's bytes a step."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch
import torch.nn as nn
from support import state_ckpt_cases as C
from support import states_cases as S
from support.distributed import run_ranks

import zero_offload as zo
from zero_offload.errors import ConfigError

pytestmark = pytest.mark.multiprocess

NVME = tempfile.mkdtemp(prefix="zo-nvme-states-")


def _case(name, clip, stage, **kw):
    return (name, None, clip, tuple(sorted({"stage": stage, "dtype": torch.float32, **kw}.items())))


def _nvme(**kw):
    return dict(offload_optimizer="nvme", nvme_path=NVME, **kw)


INT8 = dict(moment_precision="8bit")
LION = dict(optimizer_type="lion")
# (the state on NVMe, the same run with it in host memory)
PAIRS = [
    (
        _case("wide", None, 3, **INT8, **_nvme()),
        _case("wide", None, 3, **INT8, offload_optimizer="cpu"),
    ),
    (
        _case("wide", None, 3, **INT8, **_nvme(step_during_backward=True, overlap_step=True)),
        _case("wide", None, 3, **INT8, offload_optimizer="cpu"),
    ),
    (
        _case("wide", None, 3, **INT8, **_nvme(offload_optimizer_fraction=0.5)),
        _case("wide", None, 3, **INT8, offload_optimizer="cpu"),
    ),
    (  # sub-groups of 1024 elements: cuts inside the 5120-element weight, on its blocks
        _case("wide", None, 2, **INT8, **_nvme(sub_group_size=1000)),
        _case("wide", None, 2, **INT8, offload_optimizer="cpu"),
    ),
    (
        _case("gpt", S.CLIP, 2, **LION, **_nvme()),
        _case("gpt", S.CLIP, 2, **LION, offload_optimizer="cpu"),
    ),
    (
        _case("gpt", S.CLIP, 3, **LION, **_nvme(step_during_backward=True, overlap_step=True)),
        _case("gpt", S.CLIP, 3, **LION, offload_optimizer="cpu"),
    ),
]
CASES = sorted({c for pair in PAIRS for c in pair})


@functools.lru_cache(maxsize=None)
def results(world: int) -> dict:
    return run_ranks(world, S.run_cases, CASES)[0]


def _id(pair) -> str:
    kw = dict(pair[0][3])
    skip = {"offload_optimizer", "nvme_path", "dtype"}
    return f"{pair[0][0]}-" + "-".join(f"{k}={v}" for k, v in sorted(kw.items()) if k not in skip)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("pair", PAIRS, ids=_id)
def test_nvme_state_is_the_host_state_run_bit_for_bit(world, pair):
    nvme, host = results(world)[pair[0]], results(world)[pair[1]]
    assert nvme["losses"] == host["losses"]
    a, b = nvme["params"], host["params"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_saved_on_nvme_resumes_bit_for_bit(tmp_path):
    kwargs = tuple(sorted({"stage": 3, **INT8, **_nvme(master_precision="bf16_kahan")}.items()))
    out = C.resume(0, 1, str(tmp_path), kwargs)
    a, b = out["straight"], out["resumed"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _disk_bytes(**kw) -> tuple[int, int]:
    """Optimizer bytes read and written at the second step of a 132k-param MLP whose
    weights are quantized (its biases keep fp32 moments)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    engine = zo.initialize(model, stage=3, dtype=torch.float32, **_nvme(**kw))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(8, 128, generator=gen)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    t = engine.last_step_timings
    engine.close()
    return t.bytes_read, t.bytes_written


def test_8bit_moments_move_at_most_055x_the_disk_bytes_of_fp32():
    fp32 = _disk_bytes(step_during_backward=False)
    int8 = _disk_bytes(step_during_backward=False, **INT8)
    assert int8[0] == int8[1] > 0
    assert int8[0] <= 0.55 * fp32[0] and int8[1] <= 0.55 * fp32[1], (int8, fp32)


def test_a_budget_that_sends_gradients_to_files_is_refused_naming_the_fix():
    """The fp32 AdamW pipeline would put the gradients in files; these states need them in
    host memory for now, and say so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    with pytest.raises(ConfigError, match="gradient shard .* host_memory_limit"):
        zo.initialize(model, stage=3, host_memory_limit=400_000, **_nvme(**INT8))


@pytest.mark.parametrize("limit", [680_000, 700_000])
def test_fp32_compute_with_a_bf16_master_fits_its_output_in_the_budget(limit):
    """With fp32 compute and a bf16 master the step writes a sub-group's new fp32 parameters
    into a buffer of their own (the master is not them): the budget counts it, so the state
    pipeline, the gradient shard and that buffer fit host_memory_limit, or initialize
    refuses, naming the fix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    kw = dict(stage=3, dtype=torch.float32, master_precision="bf16_kahan", sub_group_size=4096)
    try:
        engine = zo.initialize(model, host_memory_limit=limit, **_nvme(**kw))
    except ConfigError as err:
        assert "host_memory_limit" in str(err)
        return
    sizing, numel = engine.optimizer_split.sizing, engine.trainable_numel
    held = sizing.state_bytes() + sizing.grad_bytes(numel) + 4 * sizing.group
    engine.close()
    assert held <= limit, (held, limit)
