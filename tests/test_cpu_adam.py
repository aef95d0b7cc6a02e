"""CPU Adam: the exact math within float32 rounding on every code path (AVX-512, AVX2,
scalar), low-precision paths, state, fallback, errors.

Results are compared with torch's Adam(W) run in float64, within a bound derived from float32
rounding (tests/support/adam_reference.py), not with torch's float32 result under a fixed tolerance:
correct float32 implementations differ by CPU-dependent ulps. torch's own float32 run is held
to the same bound, so the bound is not fitted to the kernel.
"""

from __future__ import annotations

import copy
import logging
import os
import stat
import threading

import pytest
import torch
from support.adam_reference import Float32Bound

from zero_offload.optim import CPUAdam, CPUAdamW, adam_update
from zero_offload.optim.native import KernelBuildError
from zero_offload.optim.native import adam_kernel as K
from zero_offload.optim.native import build as native

SIZES = [1, 7, 15, 16, 17, 1023, 400_009]  # the last: many elements on every thread
HYPERS = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=0.5, betas=(0.0, 0.5), eps=1e-3, weight_decay=1e-2),  # lerp weight 1: other branch
    dict(lr=3e-4, betas=(0.3, 0.999), eps=1e-10, weight_decay=0.05),  # lerp weight 0.7
    dict(lr=1e-3, betas=(0.95, 0.95), eps=1e-8, weight_decay=1.0),
]
PATHS = [isa for isa in K.ISAS if isa != "auto"]


@pytest.fixture
def fresh_kernel_cache():
    """Forget the loaded kernel around a test that changes CC / the cache folder / the ISA."""
    K._load_cached.cache_clear()
    yield
    K._load_cached.cache_clear()


@pytest.fixture(params=PATHS)
def isa(request, monkeypatch) -> str:
    """Run the test on one code path of the kernel, chosen the documented way
    (``ZERO_OFFLOAD_ISA``); the kernel is required, so a silent torch fallback cannot pass.
    Skips only a path this CPU lacks, saying why."""
    monkeypatch.setenv("ZERO_OFFLOAD_ISA", request.param)
    monkeypatch.setenv("ZERO_OFFLOAD_KERNELS", "required")
    try:
        k = K.get_kernel()
    except K.IsaUnavailable as exc:
        pytest.skip(str(exc))
    assert k is not None and k.vec_path == request.param
    return request.param


def _grads(
    n: int, steps: int, seed: int, shape: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        scale = 10.0 ** (s % 5 - 3)  # 1e-3 .. 10: exercises eps and large steps
        out.append((torch.randn(n, generator=gen) * scale).reshape(shape or (n,)))
    return out


def _run_pair(
    n: int,
    hyper: dict,
    adamw: bool,
    steps: int = 20,
    grad_dtype=torch.float32,
    shape: tuple[int, ...] | None = None,
    seed: int = 0,
):
    """Train the same param with CPUAdam, torch in float32 and torch in float64 (the
    reference with its float32 rounding bound): ours, its optimizer, torch's, its optimizer,
    the reference."""
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).reshape(shape or (n,))
    ours, ref = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    opt = CPUAdam([ours], adamw=adamw, **hyper)
    ref_opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], **hyper)
    exact = Float32Bound(p0, adamw=adamw, **hyper)
    for g in _grads(n, steps, seed, shape):
        g = g.to(grad_dtype)
        ref.grad = g.float()
        if grad_dtype == torch.float32:
            ours.grad = g.clone()
            opt.step()
        else:  # a param's .grad must share its dtype: the engine's entry point takes bf16
            opt.step_param(ours, g)
        ref_opt.step()
        exact.step(g)
    return ours, opt, ref, ref_opt, exact


def _assert_exact_math(ours, opt, ref, ref_opt, exact: Float32Bound) -> None:
    """Ours and torch's float32 run both within float32 rounding of the float64 run."""
    for who, p, o in (("zero_offload", ours, opt), ("torch float32", ref, ref_opt)):
        exact.assert_within(who, p, o.state[p]["exp_avg"], o.state[p]["exp_avg_sq"])
    assert float(opt.state[ours]["step"]) == float(ref_opt.state[ref]["step"])


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("hyper", HYPERS, ids=[f"h{i}" for i in range(len(HYPERS))])
@pytest.mark.parametrize("n", SIZES[:-1])
def test_matches_exact_math_fp32(isa: str, n: int, hyper: dict, adamw: bool) -> None:
    _assert_exact_math(*_run_pair(n, hyper, adamw))


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("hyper", [HYPERS[1], HYPERS[3]], ids=["h1", "h3"])
def test_matches_exact_math_large(hyper: dict, adamw: bool) -> None:
    """Many elements on every thread, on the default path (each path is checked on the sizes
    above, and test_every_code_path_gives_identical_bits ties them together)."""
    _assert_exact_math(*_run_pair(SIZES[-1], hyper, adamw))


def test_the_bound_catches_a_slightly_wrong_update() -> None:
    """The check has teeth: a float32 Adam whose lr is off by one part in 10^4 is outside."""
    n, hyper = 1023, HYPERS[1]
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    wrong = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([wrong], **{**hyper, "lr": hyper["lr"] * (1 + 1e-4)})
    exact = Float32Bound(p0, adamw=True, **hyper)
    for g in _grads(n, 20, 0):
        wrong.grad = g.clone()
        opt.step()
        exact.step(g)
    with pytest.raises(AssertionError, match="beyond float32 rounding"):
        exact.assert_within(
            "off by 1e-4", wrong, opt.state[wrong]["exp_avg"], opt.state[wrong]["exp_avg_sq"]
        )


def test_shaped_params_and_cpuadamw() -> None:
    p0 = torch.randn(33, 31)
    ours, ref = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    opt, ref_opt = CPUAdamW([ours], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    assert opt.param_groups[0]["weight_decay"] == ref_opt.param_groups[0]["weight_decay"] == 1e-2
    exact = Float32Bound(p0, adamw=True, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    for g in _grads(33 * 31, 20, 3, (33, 31)):
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        exact.step(g)
    _assert_exact_math(ours, opt, ref, ref_opt, exact)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [17, 1023, 100_003])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_low_precision_grads(isa: str, grad_dtype: torch.dtype, n: int, adamw: bool) -> None:
    _assert_exact_math(*_run_pair(n, HYPERS[1], adamw, grad_dtype=grad_dtype))


def _special_params(dtype: torch.dtype) -> torch.Tensor:
    """Values where rounding to bf16/fp16 is easy to get wrong: exact ties (odd and even),
    just off ties, fp32 denormals, fp16 denormals, fp16 overflow, infinities, signed zeros."""
    bits = [
        0x3F808000,
        0x3F818000,
        0x3F808001,
        0x3F817FFF,
        0x00000001,
        0x807FFFFF,
        0x00008000,
        0x7F7FFFFF,
        0x7F7F8000,
        0x7F800000,
        0xFF800000,
        0x80000000,
        0x00000000,
    ]
    vals = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    extra = torch.tensor(
        [
            65504.0,
            65519.0,
            65520.0,
            -65520.0,
            6e-8,
            3e-8,
            2.9e-8,
            1e-6,
            6.1e-5,
            1.0 + 2**-11,
            1.0 + 3 * 2**-11,
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
        ]
    )
    rand = (
        torch.randn(4000, generator=torch.Generator().manual_seed(9))
        * 10.0
        ** torch.randint(-12, 6, (4000,), generator=torch.Generator().manual_seed(10)).float()
    )
    return torch.cat([vals, extra, rand, vals, extra])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1, 13])
def test_fused_out_rounds_like_torch(isa: str, out_dtype: torch.dtype, offset: int) -> None:
    p = _special_params(out_dtype)
    n = p.numel()
    m, v = torch.zeros(n), torch.zeros(n)
    storage = torch.zeros(n + offset, dtype=out_dtype)
    out = storage[offset:]  # contiguous but not line-aligned: the unaligned head path
    g = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for step, lr in ((1, 0.0), (2, 1e-3)):  # lr 0 keeps the special values as they are
        adam_update(
            p,
            g,
            m,
            v,
            step=step,
            lr=lr,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            out=out,
        )
        expect = p.to(out_dtype)
        assert torch.equal(out.view(torch.int16), expect.view(torch.int16))


def test_nan_out_stays_nan(isa: str) -> None:
    p = torch.tensor([float("nan")] * 40 + [1.0] * 40)
    out = torch.zeros(80, dtype=torch.bfloat16)
    adam_update(
        p,
        torch.ones(80),
        torch.zeros(80),
        torch.zeros(80),
        step=1,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        out=out,
    )
    assert torch.isnan(out[:40]).all() and torch.equal(out[40:], p[40:].bfloat16())


def test_multithread_split_equals_single_thread(isa: str) -> None:
    n = 1_000_003
    base = torch.randn(n, generator=torch.Generator().manual_seed(4))
    g = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    results = []
    for threads in (1, 2, 3, 5):
        p, m, v = base.clone(), base.abs() * 0.1, base.square() * 1e-3
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2, 3):
            adam_update(
                p,
                g,
                m,
                v,
                step=step,
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.1,
                out=out,
                num_threads=threads,
            )
        results.append((p, m, v, out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_python_thread_split_equals_openmp(isa: str) -> None:
    k = K.get_kernel()
    n = 300_007
    g = torch.randn(n, generator=torch.Generator().manual_seed(6)).half()
    sc = K.adam_scalars(
        step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adamw=False
    )
    runs = []
    for openmp in (True, False):
        p, m, v = torch.ones(n), torch.full((n,), 0.1), torch.full((n,), 0.01)
        out = torch.empty(n, dtype=torch.float16)
        assert K.native_update(k, p, g, m, v, out, sc, 3, openmp) == 0
        runs.append((p, m, v, out))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_every_code_path_gives_identical_bits() -> None:
    """AVX-512, AVX2 and scalar builds perform the same IEEE operations (explicit FMAs, no
    contraction), so they agree bit for bit, including unaligned heads and tails."""
    kernels = {}
    for path in PATHS:
        try:
            kernels[path] = K.load_kernel(path)
        except K.IsaUnavailable:
            continue  # a path this CPU lacks; scalar is always there
    assert "scalar" in kernels and len(kernels) >= 1
    n = 50_001
    base = torch.randn(n, generator=torch.Generator().manual_seed(7))
    cases = (
        (torch.float32, None, True),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.float16, torch.float16, True),
        (torch.float32, torch.bfloat16, False),
    )
    for gd, od, adamw in cases:
        g = base.flip(0).to(gd)
        sc = K.adam_scalars(
            step=2, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw
        )
        runs = {}
        for path, kern in kernels.items():
            p, m, v = base.clone(), base.abs() * 0.1, base.square()
            out = None if od is None else torch.empty(n + 3, dtype=od)[3:]
            for lo, hi in ((0, 5), (5, 1029), (1029, n)):  # unaligned ranges
                sl = slice(lo, hi)
                assert (
                    K.native_update(
                        kern, p[sl], g[sl], m[sl], v[sl], None if out is None else out[sl], sc, 1
                    )
                    == 0
                )
            runs[path] = [p, m, v] + ([] if out is None else [out.view(torch.int16)])
        first = next(iter(runs))
        for path, tensors in runs.items():
            for a, b in zip(runs[first], tensors):
                assert torch.equal(a, b), (first, path, gd, od)


def test_isa_choice_is_validated(monkeypatch, caplog, fresh_kernel_cache) -> None:
    monkeypatch.setenv("ZERO_OFFLOAD_ISA", "sse9")
    with pytest.raises(ValueError, match="ZERO_OFFLOAD_ISA='sse9' is not one of"):
        K.get_kernel()
    # A path the CPU lacks: on a machine that is not x86, avx512 cannot be built.
    monkeypatch.setattr(native, "X86", False)
    monkeypatch.setenv("ZERO_OFFLOAD_ISA", "avx512")
    monkeypatch.setenv("ZERO_OFFLOAD_KERNELS", "required")
    with pytest.raises(K.IsaUnavailable, match="ZERO_OFFLOAD_ISA=avx512"):
        K.get_kernel()
    monkeypatch.setenv("ZERO_OFFLOAD_KERNELS", "auto")
    with caplog.at_level(logging.WARNING, logger="zero_offload.optim.native.adam_kernel"):
        assert K.get_kernel() is None  # auto: warned, and torch does the update
    assert "falling back" in caplog.text and "avx512" in caplog.text


def test_state_dict_round_trip_and_torch_interop() -> None:
    p = torch.randn(1000).requires_grad_()
    hyper = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05)
    opt = CPUAdam([p], **hyper)
    grads = _grads(1000, 10, 11)
    for g in grads[:5]:
        p.grad = g.clone()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    exact = Float32Bound(p, adamw=True, **hyper, state=saved["state"][0])
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    q = p.detach().clone().requires_grad_()
    opt2 = CPUAdam([q], lr=1.0)  # hyperparameters come from the state dict
    opt2.load_state_dict(copy.deepcopy(saved))  # load_state_dict keeps the tensors it gets
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[0]["adamw"] is True
    r = p.detach().clone().requires_grad_()
    torch_opt = torch.optim.AdamW([r], lr=1.0)
    torch_opt.load_state_dict(copy.deepcopy(saved))  # our state dict is a valid torch AdamW one
    for g in grads[5:]:
        p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
        opt.step()
        opt2.step()
        torch_opt.step()
        exact.step(g)
    assert torch.equal(p, q)
    _assert_exact_math(p, opt, r, torch_opt, exact)
    back = CPUAdam([p.detach().clone()])
    back.load_state_dict(torch_opt.state_dict())  # and torch's loads into ours
    assert float(back.state[back.param_groups[0]["params"][0]]["step"]) == 10.0


def test_lr_scheduler_takes_effect() -> None:
    p0 = torch.randn(257)
    ours, ref = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    opt, ref_opt = CPUAdam([ours], lr=1e-1), torch.optim.AdamW([ref], lr=1e-1)
    exact = Float32Bound(p0, adamw=True, lr=1e-1, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    scheds = [
        torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.1)
        for o in (opt, ref_opt, exact.opt)
    ]
    for g in _grads(257, 10, 12):
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        exact.step(g)
        for sched in scheds:
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    _assert_exact_math(ours, opt, ref, ref_opt, exact)
    opt.param_groups[0]["lr"] = 0.0  # with lr 0 (and so no decay) nothing moves
    before = ours.detach().clone()
    ours.grad = torch.randn(257)
    opt.step()
    assert torch.equal(ours, before)


def test_step_param_uses_its_group_and_state() -> None:
    a, b = torch.zeros(100), torch.zeros(64)
    opt = CPUAdam([{"params": [a], "lr": 1e-1}, {"params": [b], "lr": 1e-3}], weight_decay=0.0)
    out = torch.empty(64, dtype=torch.bfloat16)
    opt.step_param(b, torch.ones(64, dtype=torch.bfloat16), out=out)
    opt.step_param(b, torch.ones(64, dtype=torch.bfloat16), out=out)
    assert float(opt.state[b]["step"]) == 2 and a not in opt.state
    torch.testing.assert_close(b, torch.full((64,), -2e-3), rtol=1e-5, atol=0)
    assert torch.equal(out, b.bfloat16())
    with pytest.raises(KeyError):
        opt.step_param(torch.zeros(3), torch.zeros(3))


@pytest.mark.parametrize("mode", ["off", "no-compiler"])
def test_fallback_gives_same_results(
    mode: str, monkeypatch, tmp_path, caplog, fresh_kernel_cache
) -> None:
    if mode == "off":
        monkeypatch.setenv("ZERO_OFFLOAD_KERNELS", "off")
    else:
        monkeypatch.setenv("ZERO_OFFLOAD_KERNELS", "auto")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        monkeypatch.setenv("ZERO_OFFLOAD_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="zero_offload.optim.native.adam_kernel"):
        assert K.get_kernel() is None
        for adamw in (True, False):
            _assert_exact_math(*_run_pair(1023, HYPERS[1], adamw))
        p, out = torch.randn(99), torch.empty(99, dtype=torch.float16)
        adam_update(
            p,
            torch.randn(99).bfloat16(),
            torch.zeros(99),
            torch.zeros(99),
            step=1,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            out=out,
        )
        assert torch.equal(out, p.half())
    warnings = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warnings) == (0 if mode == "off" else 1)
    if mode == "no-compiler":
        assert "no C compiler" in warnings[0].getMessage()
        monkeypatch.setenv("ZERO_OFFLOAD_KERNELS", "required")
        with pytest.raises(KernelBuildError, match="no C compiler"):
            K.get_kernel()


def test_failed_build_reports_compiler_stderr(monkeypatch, tmp_path, fresh_kernel_cache) -> None:
    cc = tmp_path / "broken-cc"
    cc.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo broken 1.0; exit 0; fi\n'
        "echo 'error: the flux capacitor is empty' >&2\nexit 1\n"
    )
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("ZERO_OFFLOAD_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KernelBuildError, match="flux capacitor"):
        native.load_library("cpu_adam")
    monkeypatch.setenv("ZERO_OFFLOAD_KERNELS", "required")
    w = torch.zeros(4, requires_grad=True)
    with pytest.raises(KernelBuildError, match="flux capacitor"):
        CPUAdam([w]).step_param(w, torch.zeros(4))
    assert not list((tmp_path / "cache").glob("*.tmp*"))  # no temp files left behind
    monkeypatch.setenv("ZERO_OFFLOAD_KERNELS", "bogus")
    with pytest.raises(ValueError, match="ZERO_OFFLOAD_KERNELS"):
        K.get_kernel()


def test_concurrent_builds_share_one_cached_library(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ZERO_OFFLOAD_CACHE", str(tmp_path))
    paths, errors = [], []

    def build() -> None:
        try:
            paths.append(native.library_path("adam_traffic"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert [f.name for f in tmp_path.iterdir()] == [paths[0].name]
    assert native.load_library("adam_traffic").zo_has_openmp() == 0
    assert native.library_path("adam_traffic", ("-fopenmp",)) != paths[0]  # flags in the key


def test_bad_tensors_raise_and_change_nothing() -> None:
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    p, m, v, g = torch.ones(8, 8), torch.zeros(8, 8), torch.zeros(8, 8), torch.ones(8, 8)
    with pytest.raises(ValueError, match="not contiguous"):
        adam_update(p.t(), g, m, v, **hyper)
    with pytest.raises(ValueError, match="not contiguous"):
        adam_update(p, g[:, ::2].repeat(1, 2).t(), m, v, **hyper)
    with pytest.raises(TypeError, match="float64"):
        adam_update(p.double(), g, m, v, **hyper)
    with pytest.raises(TypeError, match="int32"):
        adam_update(p, g.int(), m, v, **hyper)
    with pytest.raises(TypeError, match="out"):
        adam_update(p, g, m, v, out=torch.empty(64), **hyper)
    with pytest.raises(ValueError, match="elements"):
        adam_update(p, g, m[:4], v, **hyper)
    with pytest.raises(ValueError, match="step"):
        adam_update(p, g, m, v, **{**hyper, "step": 0})
    assert torch.equal(p, torch.ones(8, 8)) and torch.equal(m, torch.zeros(8, 8))
    q = torch.ones(8, 8).t().requires_grad_()
    opt = CPUAdam([q])
    q.grad = torch.ones(8, 8)
    with pytest.raises(ValueError, match="not contiguous"):
        opt.step()
    assert len(opt.state[q]) == 0  # no state, no step counted
    r = torch.ones(8, dtype=torch.float64, requires_grad=True)
    r.grad = torch.ones(8, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        CPUAdam([r]).step()


def test_unsupported_options() -> None:
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match="maximize"):
        CPUAdamW(p, maximize=True)
    with pytest.raises(ValueError, match="beta"):
        CPUAdam(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="num_threads"):
        CPUAdam(p, num_threads=0)


def test_default_threads_are_physical_cores() -> None:
    assert 1 <= K.default_num_threads() <= (os.cpu_count() or 1)
