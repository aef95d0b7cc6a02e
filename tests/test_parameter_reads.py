"""Stage 3 parameters read outside a forward while the engine is open: between gathers their
memory is released, so each read either sees the right values (inside
``engine.gathered_parameters()``) or raises an error naming that fix — never reads freed
memory. The patterns run in one subprocess per tier: a crash shows as its exit code."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
import torch
import torch.nn as nn
from support.children import run_python
from support.distributed import run_ranks
from support.models import MLP, batch, loss_fn

import zero_offload as zo

ACCESSES = {
    "sum": "float(sum(p.sum() for p in model.parameters()))",
    "state_dict": "{k: v.clone() for k, v in model.state_dict().items()}",
    "print": "repr(first)",
    "data": "first.data.clone()",
    "detach": "first.detach().clone()",
    "inplace": "with torch.no_grad(): first.mul_(1.0)",
    "deepcopy": "__import__('copy').deepcopy(model)",
}

# Every access pattern in turn, each on a fresh model and engine, in one process per tier (a
# process per pattern spent most of its time importing torch). A crash ends the process: the
# patterns after it then show no lines and their tests fail with its stderr.
SCRIPT = """
import sys, torch, zero_offload as zo
from zero_offload.params.released import ParameterNotGatheredError
from support.models import TinyGPT, batch, loss_fn
offload_param, nvme = sys.argv[1], sys.argv[2]
{accesses}
def run(name, access):
    torch.manual_seed(0)
    model = TinyGPT()
    engine = zo.initialize(model, stage=3, lr=1e-2, offload_param=offload_param,
                           nvme_path=f"{{nvme}}/{{name}}")
    def step(i):
        x, y = batch("gpt", 4, torch.Generator().manual_seed(i))
        engine.backward(loss_fn("gpt", engine(x), y)); engine.step()
    step(0)
    first = next(model.parameters())
    try:
        access(model, first)
    except ParameterNotGatheredError as err:
        assert "engine.gathered_parameters()" in str(err), err
        print(name, "refused", flush=True)
    trained = engine.full_state_dict()
    with engine.gathered_parameters():
        access(model, first)
        state = model.state_dict()
        model(batch("gpt", 2, torch.Generator().manual_seed(5))[0])  # evaluation
        assert torch.equal(first.detach(), state["wte.weight"])
        after = model.state_dict()
    assert set(state) == set(trained)
    for k, v in trained.items():
        assert torch.equal(state[k], v), k
        assert torch.equal(after[k], v), k
    step(1)
    engine.close()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    print(name, "survived", float(first.sum()), flush=True)
for name in {names!r}:
    run(name, globals()["access_" + name])
"""


def _script() -> str:
    accesses = "".join(
        f"def access_{name}(model, first):\n    {code}\n" for name, code in ACCESSES.items()
    )
    return textwrap.dedent(SCRIPT).format(accesses=accesses, names=list(ACCESSES))


@pytest.fixture(scope="module")
def reads(tmp_path_factory):
    """offload_param -> the finished process that ran every access pattern on that tier."""
    done: dict[str, subprocess.CompletedProcess] = {}

    def get(offload_param: str) -> subprocess.CompletedProcess:
        if offload_param not in done:
            nvme = tmp_path_factory.mktemp(f"reads_{offload_param}")
            done[offload_param] = run_python(_script(), offload_param, str(nvme))
        return done[offload_param]

    return get


@pytest.mark.parametrize("access", list(ACCESSES))
@pytest.mark.parametrize("offload_param", ["none", "nvme"])
def test_a_released_parameter_read_raises_a_clear_error_and_reads_right_when_gathered(
    reads, access, offload_param
):
    """Outside a forward: the read raises ParameterNotGatheredError naming
    gathered_parameters() (on the old code: SIGSEGV, or a raw setStorage error for repr).
    Inside ``engine.gathered_parameters()``: the values are the trained ones
    (``full_state_dict``), a forward inside keeps them gathered, and the engine trains on."""
    result = reads(offload_param)
    lines = [line.split()[:2] for line in result.stdout.splitlines()]
    assert [access, "refused"] in lines and [access, "survived"] in lines, (
        f"exit {result.returncode}: {result.stderr[-3000:]}"
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_metadata_stays_readable_and_other_stages_need_no_gather():
    model = MLP()
    engine = zo.initialize(model, stage=3)
    p = model.net[0].weight
    assert p.shape == (32, 16) and p.dtype == torch.float32 and p.requires_grad
    assert p.numel() == 512 and p.dim() == 2 and p.grad is None and isinstance(p, nn.Parameter)
    model.cpu().to(torch.float32)  # already there: no memory touched (Lightning's teardown)
    with pytest.raises(ValueError, match="not one of the engine's model"):
        with engine.gathered_parameters([nn.Parameter(torch.ones(2))]):
            pass
    with engine.gathered_parameters([p]):  # one unit only
        assert torch.isfinite(p.sum())
    engine.close()
    model = MLP()
    engine = zo.initialize(model, stage=2)
    with engine.gathered_parameters():  # stages 0-2: the parameters themselves
        before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batch("mlp", 4, torch.Generator().manual_seed(0))
    engine.backward(loss_fn("mlp", engine(x), y))
    engine.step()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    engine.close()


def _gathered_on_ranks(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    model = MLP()
    engine = zo.initialize(model, stage=3, lr=1e-2)
    x, y = batch("mlp", 4 * world_size, torch.Generator().manual_seed(0))
    engine.backward(loss_fn("mlp", engine(x[rank::world_size]), y[rank::world_size]))
    engine.step()
    full = engine.full_state_dict()
    with engine.gathered_parameters():
        state = {k: v.clone() for k, v in model.state_dict().items()}
    engine.close()
    return set(state) == set(full) and all(torch.equal(state[k], full[k]) for k in full)


@pytest.mark.multiprocess
def test_gathered_parameters_on_two_ranks_holds_the_full_trained_values():
    assert run_ranks(2, _gathered_on_ranks) == [True, True]
