"""The engine carries every optimizer kind and state precision in host memory (stages 1-3,
offload_optimizer="cpu" and, on a CPU device, no offload): it trains to the parameters of
optimizers we did not write on the same global batch (torch's Adagrad, Lion as its paper
writes it, zero_offload.optim.CPUAdamW8bit, which test_cpu_optim holds to bitsandbytes'
AdamW8bit), and every CPU tier computes the same bits."""

from __future__ import annotations

import functools

import pytest
import torch
from support import states_cases as S
from support.distributed import run_ranks

from zero_offload.errors import ConfigError

pytestmark = pytest.mark.multiprocess

F32 = ("dtype", torch.float32)


def _case(name, ref, clip, stage, **kw):
    return (name, ref, clip, tuple(sorted({"stage": stage, "dtype": torch.float32, **kw}.items())))


LION = [_case("gpt", "lion", S.CLIP, s, optimizer_type="lion") for s in (1, 2, 3)]
ADAGRAD = [_case("gpt", "adagrad", S.CLIP, s, optimizer_type="adagrad") for s in (1, 2, 3)]
INT8 = [_case("wide", "adamw8bit", None, s, moment_precision="8bit") for s in (1, 2, 3)]
INT8_CPU = [
    _case("wide", "adamw8bit", None, 3, moment_precision="8bit", offload_optimizer="cpu"),
    _case("gpt", "lion", S.CLIP, 2, optimizer_type="lion", offload_optimizer="cpu"),
]
LOW = [
    _case("wide", "adamw", S.CLIP, s, moment_precision=mo, master_precision=ma)
    for s, mo, ma in ((2, "bf16", "fp32"), (3, "8bit", "bf16_kahan"), (1, "bf16", "bf16_sr"))
]
CASES = LION + ADAGRAD + INT8 + INT8_CPU + LOW


@functools.lru_cache(maxsize=None)
def results(world: int) -> dict:
    return run_ranks(world, S.run_cases, CASES)[0]


def _diffs(r: dict) -> tuple[float, float]:
    ref = r["reference"]
    d = torch.cat([(r["params"][k] - ref[k]).abs().flatten() for k in r["params"]])
    return d.max().item() / S.LR, d.mean().item()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", LION + ADAGRAD, ids=lambda c: f"{c[1]}-stage{dict(c[3])['stage']}")
def test_fp32_kinds_match_plain_torch(world, case):
    max_lr, mean = _diffs(results(world)[case])
    if case[1] == "adagrad":
        assert max_lr <= 0.03 and mean <= 1e-6, (max_lr, mean)
    else:  # a momentum within rounding of zero may take the other sign: 2 lr for that element
        assert max_lr <= 2.01 and mean <= 1e-5, (max_lr, mean)


@pytest.mark.parametrize("case", INT8, ids=lambda c: f"stage{dict(c[3])['stage']}")
def test_8bit_adamw_is_cpu_adamw8bit_bit_for_bit_on_one_rank(case):
    """One rank: each parameter is one piece of the run, its blocks those of CPUAdamW8bit on
    the parameter, the gradients the same bits: parameters and (dequantized) moments equal."""
    r = results(1)[case]
    ref = r["reference"]
    for k, v in {**r["params"], **r["moments"]}.items():
        assert torch.equal(v, ref[k]), k


@pytest.mark.parametrize("case", INT8, ids=lambda c: f"stage{dict(c[3])['stage']}")
def test_8bit_adamw_on_two_ranks_stays_with_cpu_adamw8bit(case):
    """Two ranks: gradients summed across ranks round differently, and a shard boundary
    cuts a block in two (each with its absmax): a moment code may move by one map entry,
    which moves a parameter by a fraction of lr."""
    max_lr, mean = _diffs(results(2)[case])
    assert max_lr <= 0.5 and mean <= 1e-4, (max_lr, mean)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", INT8_CPU, ids=lambda c: f"{c[1]}-stage{dict(c[3])['stage']}")
def test_host_offload_is_the_cpu_device_run_bit_for_bit(world, case):
    same = dict(case[3])
    del same["offload_optimizer"]
    twin = (case[0], case[1], case[2], tuple(sorted(same.items())))
    a, b = results(world)[case]["params"], results(world)[twin]["params"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", LOW, ids=lambda c: "-".join(str(v) for _, v in c[3]))
def test_low_precision_states_train_like_fp32_adamw(world, case):
    r = results(world)[case]
    assert r["losses"][-1] < r["losses"][0]
    max_lr, mean = _diffs(r)
    assert max_lr <= 1.0 and mean <= 0.05 * S.LR, (max_lr, mean)


def test_a_policy_on_an_accelerator_optimizer_is_refused():
    from zero_offload.config import build_config
    from zero_offload.optim import StateLayout
    from zero_offload.update.factory import make_updater

    cfg = build_config(stage=1, optimizer_type="lion")
    layout = StateLayout.uniform(cfg.optimizer.policy, 8)
    with pytest.raises(ConfigError, match='offload_optimizer="cpu"'):
        make_updater(8, cfg, torch.device("meta"), torch.bfloat16, 0, state_layout=layout)


def test_the_ledger_counts_the_smaller_state():
    """8-bit moments with a bf16_sr master: the host holds what the layout says (master 2
    bytes, each moment a code per element and an fp32 absmax per 256-element block, 4 more
    bytes for elements of tensors under 4096), where fp32 AdamW holds 12 bytes each."""
    from support import state_ckpt_cases as C

    from zero_offload.optim import StateLayout

    kw = dict(stage=1, offload_optimizer="cpu", moment_precision="8bit")
    engine = C.build(master_precision="bf16_sr", **kw)
    fp32 = C.build(stage=1, offload_optimizer="cpu")
    C.train(engine, C.batches(1))
    C.train(fp32, C.batches(1))
    held = engine.memory_report().bytes["host"]["optimizer"]
    n = engine.trainable_numel
    units = sorted(engine.units, key=lambda u: u.shard_offset)
    layout = StateLayout.for_shards(engine.state_policy, [(u.layout, 0) for u in units])
    # the wide model: a 5120-element weight quantized (20 blocks), the rest fp32 moments
    assert layout.blocks == 20 and layout.side_numel == n - 5120
    assert held == 2 * n + 2 * (n + 4 * layout.blocks + 4 * layout.side_numel) == layout.nbytes
    assert fp32.memory_report().bytes["host"]["optimizer"] == 12 * n
    engine.close()
    fp32.close()


def test_no_decay_parameters_step_without_weight_decay():
    """Each range carries its own weight decay: Lion with the biases in no_decay equals the
    plain-torch Lion with the biases in a group of weight_decay 0."""
    import copy

    torch.manual_seed(0)
    model = S.make_model("wide")
    initial = copy.deepcopy(model)
    names = ["0.bias", "2.bias"]
    engine, _, _ = S.train(0, 1, "wide", None, stage=2, optimizer_type="lion", no_decay=names)
    ref = copy.deepcopy(initial)
    groups = [
        {"params": [p for n, p in ref.named_parameters() if n not in names]},
        {"params": [p for n, p in ref.named_parameters() if n in names], "weight_decay": 0.0},
    ]
    opt = S.Lion(groups, lr=S.LR, weight_decay=S.WD)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(S.STEPS):
        x, y = S._batch("wide", gen)
        S._loss("wide", ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    got = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    engine.close()


class _Branches(torch.nn.Module):
    """A branch that only some steps use: its parameters miss those updates."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 320)
        self.b = torch.nn.Linear(16, 320)
        self.out = torch.nn.Linear(320, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x) + (self.b(x) if use_b else 0)
        return self.out(torch.tanh(h))


def test_parameters_that_miss_updates_keep_their_own_step_count():
    """8-bit AdamW: a parameter without a gradient in a step is not stepped and its bias
    correction does not advance, as CPUAdamW8bit (and torch) skip a parameter with no .grad."""
    import copy

    import zero_offload as zo
    from zero_offload.optim import CPUAdamW8bit

    torch.manual_seed(0)
    model = _Branches()
    ref = copy.deepcopy(model)
    engine = zo.initialize(
        model, stage=2, lr=S.LR, weight_decay=S.WD, moment_precision="8bit", dtype=torch.float32
    )
    opt = CPUAdamW8bit(ref.parameters(), lr=S.LR, weight_decay=S.WD)
    gen = torch.Generator().manual_seed(7)
    for step in range(6):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        use_b = step % 3 == 0
        engine.backward(torch.nn.functional.mse_loss(engine(x, use_b), y))
        engine.step()
        torch.nn.functional.mse_loss(ref(x, use_b), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    engine.close()
