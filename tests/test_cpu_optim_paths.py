"""Every compiled path of the optimizer kernel (AVX-512, AVX2, the default build) gives the
scalar reference's bits on the inputs where paths could part: lengths that leave vector
tails, rows that start and end inside a block, zero blocks, infinities, negative values,
every code of both maps, and moments that land exactly on (and one ulp beside) each decision
point of the 8-bit quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zero_offload.errors import IsaUnavailable, KernelBuildError
from zero_offload.optim import ShardState, StateLayout, StatePolicy, StepHyper, quant
from zero_offload.optim.native import optim_kernel as OK
from zero_offload.partition import build_layout

POLICIES = [
    StatePolicy("adamw", "8bit", "fp32"),
    StatePolicy("adam", "8bit", "bf16_kahan"),
    StatePolicy("lion", "8bit", "bf16_sr"),
    StatePolicy("adamw", "bf16", "fp32"),
    StatePolicy("lion", "bf16", "bf16_sr"),
    StatePolicy("adagrad", "fp32", "fp32"),
]
LENGTHS = (1, 15, 17, 255, 256, 257, 1000, 4099)
USUAL_FP32 = (torch.float32, None)  # fp32 grads, the master stepped in place
USUAL_BF16 = (torch.bfloat16, torch.bfloat16)  # bf16 grads in, bf16 params out


def _name(p: StatePolicy) -> str:
    return f"{p.kind.value}-{p.moments.value}-{p.master.value}"


@pytest.fixture(scope="module")
def reference():
    try:
        return OK.load_optim_kernel("scalar")
    except KernelBuildError as exc:
        pytest.skip(f"the optimizer kernel does not build here: {exc}")


def _paths() -> list:
    """Each vector path this machine builds (at least the default build)."""
    out = [OK.load_optim_kernel("auto")]
    for isa in ("avx512", "avx2"):
        try:
            k = OK.load_optim_kernel(isa)
        except IsaUnavailable:
            continue
        if k.vec_path not in [p.vec_path for p in out]:
            out.append(k)
    return out


def _layouts(policy: StatePolicy) -> list[StateLayout]:
    """Runs of odd lengths, and one whose pieces start and end inside 8-bit blocks."""
    runs = [StateLayout.uniform(policy, n) for n in LENGTHS]
    a = build_layout([("w", (3, 37)), ("b", (300,)), ("u", (517,))], 3)
    b = build_layout([("e", (259,)), ("n", (3,))], 3)
    return runs + [StateLayout.for_shards(policy, [(a, 1), (b, 1)])]


def _near_thresholds(n: int, gen: torch.Generator) -> torch.Tensor:
    """n values: each decision point of the signed map and its two fp32 neighbours, every
    block holding -1.0 and 1.0 so its absmax is 1 and a normalized moment is its value."""
    t = quant.thresholds(True)
    below, above = torch.nextafter(t, torch.tensor(-2.0)), torch.nextafter(t, torch.tensor(2.0))
    pts = torch.cat([t, below, above])
    pts = pts[torch.randperm(pts.numel(), generator=gen)]
    x = pts.repeat(n // pts.numel() + 1)[:n].clone()
    x[::64] = -1.0
    x[1::64] = 1.0
    return x


def _squares_near(t: torch.Tensor) -> torch.Tensor:
    """fp32 values g with fl(g * g) on or next to each of ``t`` (v = g * g with beta2 = 0)."""
    r = np.sqrt(t.double().numpy()).astype(np.float32)
    cand = np.concatenate([r, np.nextafter(r, 0), np.nextafter(r, 2)]).astype(np.float32)
    return torch.from_numpy(cand)


def _state(policy: StatePolicy, lay: StateLayout, gen: torch.Generator, case: str):
    span = lay.span()
    st = ShardState.zeros(span)
    n = lay.numel
    master = torch.randn(n, generator=gen)
    master[::7] = 0.0
    st.load_fp32({"master": master})
    g = torch.randn(n, generator=gen) * torch.logspace(-9, 1, n)
    g[torch.randperm(n, generator=gen)[: n // 5]] *= -1
    g[::11] = 0.0
    if case == "specials":
        g[3::97] = float("inf")
        g[5::101] = float("-inf")
        g[: min(n, 300)] = 0.0  # a block of zeros
    if case == "thresholds":
        # beta1 = beta2 = 0: m = g and v = fl(g * g), each block's absmax 1
        g = _near_thresholds(n, gen)
        if policy.kind.value != "lion":
            sq = _squares_near(quant.thresholds(False))
            g[2::3] = sq.repeat(n // sq.numel() + 1)[: g[2::3].numel()]
            g[::64] = 1.0
    for name, m in st.moments.items():
        if m.absmax is not None:  # every code of the map, blocks of scales 0 .. 10
            m.values.copy_(torch.randint(0, 256, m.values.shape, generator=gen).to(torch.uint8))
            m.absmax.copy_(torch.rand(m.absmax.shape, generator=gen) * 10)
            m.absmax[::5] = 0.0
            if m.side is not None and m.side.numel():
                m.side.copy_(torch.rand(m.side.shape, generator=gen))
        elif name != "master" and m.values.dtype != torch.uint8:
            src = torch.rand(m.values.shape, generator=gen)
            m.values.copy_(src if "sq" in name or policy.kind.value == "adagrad" else src - 0.5)
    return st, g


def _hyper(case: str, s: int) -> StepHyper:
    if case == "thresholds":
        return StepHyper(step=s, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
    return StepHyper(step=s, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _run(k, policy, lay, case, grad_dtype, out_dtype):
    gen = torch.Generator().manual_seed(len(case) * 1000 + lay.numel)
    st, g = _state(policy, lay, gen, case)
    out = None if out_dtype is None else torch.zeros(lay.numel, dtype=out_dtype)
    for s in (1, 2):
        assert OK.native_step(k, st, g.to(grad_dtype), _hyper(case, s), out, 1, 0) == 0
    return st, out


@pytest.mark.parametrize("case", ["random", "specials", "thresholds"])
@pytest.mark.parametrize("policy", POLICIES, ids=_name)
def test_every_path_gives_the_reference_bits(reference, policy, case) -> None:
    if case == "thresholds" and not policy.quantized:
        pytest.skip("the decision points are the 8-bit quantization's")
    paths = _paths()
    for i, lay in enumerate(_layouts(policy)):
        # every layout with the two usual dtypes (the kernel has copies fixed to them), and
        # the others in turn
        in_turn = (
            (torch.float32, torch.bfloat16, torch.float16)[i % 3],
            (None, torch.bfloat16, torch.float32, torch.float16)[i % 4],
        )
        for gd, od in dict.fromkeys([USUAL_FP32, USUAL_BF16, in_turn]):
            _compare(reference, paths, policy, lay, case, gd, od)


def _compare(reference, paths, policy, lay, case, gd, od) -> None:
    want, want_out = _run(reference, policy, lay, case, gd, od)
    for k in paths:
        got, got_out = _run(k, policy, lay, case, gd, od)
        for (name, a), (_, b) in zip(got.tensors(), want.tensors()):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
                f"{k.vec_path} {name} n={lay.numel} grads {gd} out {od}"
            )
        if want_out is not None:
            assert torch.equal(got_out.view(torch.uint8), want_out.view(torch.uint8)), (
                f"{k.vec_path} out n={lay.numel} grads {gd} out {od}"
            )


def test_thresholds_case_hits_every_decision_point(reference) -> None:
    """The "thresholds" inputs do reach the quantizer on the decision points (so the test
    above checks the nearest-entry rule at its edges, not only random values)."""
    policy = StatePolicy("lion", "8bit", "fp32")
    lay = StateLayout.uniform(policy, 4096)
    gen = torch.Generator().manual_seed(0)
    _, g = _state(policy, lay, gen, "thresholds")
    assert torch.isin(quant.thresholds(True), g).all()
    policy = StatePolicy("adamw", "8bit", "fp32")
    _, g = _state(policy, lay, gen, "thresholds")
    assert torch.isin(quant.thresholds(False), g * g).float().mean() > 0.5
