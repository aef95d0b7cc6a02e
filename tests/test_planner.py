"""The memory planner: ZeRO's arithmetic, agreement with the engine's own ledger (also with
frozen parameters), the 13B on 4 × 24 GB recommendation (full and LoRA-style fine-tunes), and
the ``zero-offload plan`` command."""

from __future__ import annotations

import functools
import json
import tempfile
from collections import namedtuple

import pytest
import torch
from support.distributed import run_ranks

import zero_offload as zo
from zero_offload.bench.gpt import GPT, GPTConfig, synthetic_batch
from zero_offload.bench.micro import io as bench_io
from zero_offload.cli import main as cli_main
from zero_offload.cli import plan as plan_cli
from zero_offload.planning.estimate.memory import MODEL_STATE, RESIDENT, TIERS, ModelShape
from zero_offload.planning.search import planner
from zero_offload.quantities import parse_count, parse_size

# ~0.47M params: padding (to world × 64 elements per unit) is well under 1%.
LEDGER_MODEL = GPTConfig(layers=2, width=128, heads=4, vocab=512, seq=32)
LEDGER_CASES = [
    (s, o, "none")
    for s in (0, 1, 2, 3)
    for o in ("none", "cpu", "nvme")
    if not (s == 0 and o != "none")
] + [(3, "cpu", "cpu"), (3, "nvme", "cpu"), (3, "cpu", "nvme"), (3, "nvme", "nvme")]
# A partial fine-tune of LEDGER_MODEL (see _ledger_model): every stage with the optimizer on
# each tier, and stage 3 with the parameters offloaded too.
FROZEN_CASES = [(s, o, "none") for s in (1, 2, 3) for o in ("none", "cpu", "nvme")] + [
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
]
Measured = namedtuple("Measured", "tiers peak_gathered")


# -- ZeRO's arithmetic ------------------------------------------------------------------------
def test_reproduces_zero_paper_table_7_5b_on_64_gpus():
    """ZeRO (Rajbhandari et al.), Table 1: Ψ = 7.5B, N = 64, K = 12, fp16 params and grads."""
    got = [
        round(
            zo.estimate_memory(7.5e9, num_gpus=64, stage=s, dtype=torch.float16).model_state_bytes()
            / 1e9,
            1,
        )
        for s in (0, 1, 2, 3)
    ]
    assert got == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("n", [1, 4, 16])
def test_design_formulas(n):
    psi = 1_000_000 * n * 64  # divisible: no rounding
    want = {0: 16 * psi, 1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n, 3: 16 * psi // n}
    for stage, nbytes in want.items():
        e = zo.estimate_memory(psi, num_gpus=n, stage=stage)
        assert e.model_state_bytes("device") == nbytes
    # Offload moves the sharded optimizer state and the gradient shard to the host: in the
    # compute dtype, or fp32 where micro-steps are summed there.
    e = zo.estimate_memory(psi, num_gpus=n, stage=2, offload_optimizer="cpu")
    assert e.model_state_bytes("device") == 2 * psi
    assert e.model_state_bytes("host") == 12 * psi // n + 2 * psi // n
    e = zo.estimate_memory(
        psi, num_gpus=n, stage=2, offload_optimizer="cpu", gradient_accumulation_steps=2
    )
    assert e.model_state_bytes("host") == 12 * psi // n + 4 * psi // n
    e = zo.estimate_memory(psi, num_gpus=n, stage=3, offload_optimizer="nvme", offload_param="nvme")
    assert e.model_state_bytes("nvme") == 14 * psi // n


def test_meta_model_is_counted_without_allocating():
    cfg = GPTConfig.preset("13b")
    with torch.device("meta"):
        model = GPT(cfg)
    e = zo.estimate_memory(model, num_gpus=4, stage=3, offload_optimizer="nvme")
    assert e.num_params == cfg.num_params  # the tied LM head counted once
    shape = ModelShape.of(model)
    assert max(shape.module_sizes) == cfg.vocab * cfg.width  # the (tied) embedding
    assert all(p.is_meta for p in model.parameters())


def test_trainable_params_arithmetic():
    """Only the Ψt trainable params have optimizer state (12 bytes) and gradients (2 bytes);
    all Ψ keep their bf16 copy."""
    n, psi, pt = 4, 1_000_000 * 4 * 64, 10_000 * 4 * 64  # divisible: no rounding
    want = {
        0: 2 * psi + 14 * pt,
        1: 2 * psi + 2 * pt + 12 * pt // n,
        2: 2 * psi + 14 * pt // n,
        3: 2 * psi // n + 14 * pt // n,
    }
    for stage, nbytes in want.items():
        e = zo.estimate_memory(psi, num_gpus=n, stage=stage, trainable_params=pt)
        assert e.model_state_bytes("device") == nbytes
        assert (e.trainable_params, e.trainable_shard_numel) == (pt, pt if stage == 0 else pt // n)
        # all of them trainable: the same terms as without the keyword
        assert (
            zo.estimate_memory(psi, num_gpus=n, stage=stage, trainable_params=psi).terms
            == zo.estimate_memory(psi, num_gpus=n, stage=stage).terms
        )
    e = zo.estimate_memory(
        psi,
        num_gpus=n,
        stage=3,
        offload_optimizer="nvme",
        offload_param="nvme",
        trainable_params=pt,
    )
    assert e.model_state_bytes("nvme") == 2 * psi // n + 12 * pt // n
    assert e.model_state_bytes("host") == 2 * pt // n  # the bf16 gradient shard
    with pytest.raises(ValueError, match="between 0 and"):
        zo.estimate_memory(psi, num_gpus=n, stage=3, trainable_params=psi + 1)
    with pytest.raises(ValueError, match="requires_grad"):  # a model says it itself
        zo.estimate_memory(_ledger_model(frozen=True), num_gpus=n, stage=3, trainable_params=pt)


def test_bad_choices_are_config_errors():
    with pytest.raises(zo.ConfigError, match="needs stage=3"):
        zo.estimate_memory(1e6, num_gpus=2, stage=2, offload_param="cpu")
    with pytest.raises(zo.ConfigError, match="needs stage 1, 2 or 3"):
        zo.estimate_memory(1e6, num_gpus=2, stage=0, offload_optimizer="cpu")
    with pytest.raises(TypeError):
        zo.estimate_memory("13B", num_gpus=2, stage=1)


# -- agreement with the engine's ledger -------------------------------------------------------
def _ledger_model(frozen: bool = False) -> GPT:
    """LEDGER_MODEL; ``frozen``: a partial fine-tune with the (tied) embeddings and the first
    block frozen, and in the second block the attention weights frozen but not their biases
    (modules that hold both kinds), so that about a third of the parameters train."""
    model = GPT(LEDGER_MODEL)
    if frozen:
        for module in (model.wte, model.wpe, model.blocks[0]):
            module.requires_grad_(False)
        model.blocks[1].qkv.weight.requires_grad_(False)
        model.blocks[1].proj.weight.requires_grad_(False)
    return model


def _train_and_measure(
    rank: int,
    world: int,
    nvme_root: str,
    cases: list[tuple[int, str, str]],
    dtypes: tuple[str, ...],
    frozen: bool = False,
) -> dict:
    out = {}
    for dtype in dtypes:
        for stage, opt, par in cases:
            torch.manual_seed(0)
            model = _ledger_model(frozen)
            try:
                engine = zo.initialize(
                    model,
                    stage=stage,
                    offload_optimizer=opt,
                    offload_param=par,
                    dtype=dtype,
                    nvme_path=nvme_root,
                )
            except NotImplementedError:  # param offload before it lands
                continue
            x, y = synthetic_batch(LEDGER_MODEL, 2, torch.Generator().manual_seed(rank))
            for _ in range(2):  # Adam's moments appear at the first step
                engine.backward(engine(x, y))
                engine.step()
            rep = engine.memory_report()
            out[(dtype, stage, opt, par)] = Measured(
                {t: rep.total(t) for t in TIERS}, rep.peak_gathered_param_bytes
            )
            engine.close()
    return out


@functools.lru_cache(maxsize=None)
def _measured(world: int, frozen: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as root:
        cases = FROZEN_CASES if frozen else LEDGER_CASES
        if world == 1:
            return _train_and_measure(0, 1, root, cases, ("bfloat16", "float32"), frozen)
        cases = [c for c in cases if c[0] > 0]
        return run_ranks(world, _train_and_measure, root, cases, ("bfloat16",), frozen)[1]


def _check_against_ledger(world: int, key: tuple, frozen: bool = False) -> None:
    got = _measured(world, frozen).get(key)
    if got is None:
        pytest.skip("offload_param is not implemented in this engine yet")
    dtype, stage, opt, par = key
    with torch.device("meta"):
        model = _ledger_model(frozen)
    e = zo.estimate_memory(
        model,
        num_gpus=world,
        stage=stage,
        offload_optimizer=opt,
        offload_param=par,
        dtype=dtype,
        device="cpu",
    )
    for tier in TIERS:
        want = e.resident_bytes(tier)
        assert abs(got.tiers[tier] - want) <= 0.1 * max(got.tiers[tier], want), (
            f"{tier}: ledger {got.tiers[tier]} vs estimate {want}\n{e}"
        )
    if stage == 3:
        gathered = sum(t.bytes for t in e.terms if t.name == "gathered params")
        assert 0 < got.peak_gathered <= gathered * 1.1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", LEDGER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_estimate_matches_ledger_one_rank(case, dtype):
    _check_against_ledger(1, (dtype, *case))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case", [c for c in LEDGER_CASES if c[0] > 0], ids=lambda c: "-".join(map(str, c))
)
def test_estimate_matches_ledger_two_ranks(case):
    _check_against_ledger(2, ("bfloat16", *case))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", FROZEN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_estimate_matches_ledger_with_frozen_params_one_rank(case, dtype):
    _check_against_ledger(1, (dtype, *case), frozen=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", FROZEN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_estimate_matches_ledger_with_frozen_params_two_ranks(case):
    _check_against_ledger(2, ("bfloat16", *case), frozen=True)


def test_frozen_params_have_units_of_their_own():
    """The estimate lays out the engine's units: with frozen parameters, optimizer state and
    gradients cover only the trainable prefix of each rank's shard."""
    with torch.device("meta"):
        model = _ledger_model(frozen=True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelShape.of(model).trainable_params == trainable < LEDGER_MODEL.num_params / 2
    for stage in (1, 2, 3):
        e = zo.estimate_memory(model, num_gpus=2, stage=stage)
        assert trainable / 2 <= e.trainable_shard_numel < e.shard_numel
        opt = next(t for t in e.terms if t.name == "optimizer state")
        assert opt.bytes == 12 * e.trainable_shard_numel and "12Ψt/N" in opt.formula


# -- plan ----------------------------------------------------------------------------------
def _13b():
    with torch.device("meta"):
        return GPT(GPTConfig.preset("13b"))


@pytest.mark.parametrize("model", [13e9, "meta"])
def test_plan_13b_on_4x24gb(model):
    model = _13b() if model == "meta" else model
    p = zo.plan(model, num_gpus=4, gpu_memory=24e9, host_memory=128e9)
    assert p.fits and p.kwargs["stage"] == 3
    e = zo.estimate_memory(
        model,
        num_gpus=4,
        stage=3,
        offload_optimizer=p.kwargs["offload_optimizer"],
        offload_param=p.kwargs["offload_param"],
    )
    assert e.gpu_bytes <= 0.9 * 24e9 and e.host_bytes_per_node <= 0.9 * 128e9
    # Stage 2 without offload: the replicated bf16 params alone (26 GB) exceed a 24 GB GPU.
    stage2 = next(
        c
        for c in p.candidates
        if (c.stage, c.offload_optimizer, c.offload_param) == (2, "none", "none")
    )
    assert not stage2.fits
    params_gb = f"params {2 * stage2.estimate.num_params / 1e9:.1f} GB"
    assert "GPU" in stage2.reasons[0] and params_gb in stage2.reasons[0]
    assert "only stage 3 shards them" in stage2.reasons[0]
    assert any("not checked" in n for n in p.notes)  # NVMe space was not measured


def test_plan_13b_lora_on_4x24gb_needs_no_offload():
    """13B with 50M trainable (LoRA adapters) on 4 × 24 GB, 128 GB host: the full fine-tune
    needs the optimizer state on NVMe; with only Ψt = 50M trained, stage 3 without any offload
    fits. Stages 0-2 still do not: their replicated bf16 params are 26 GB whatever trains."""
    psi, pt, n = 13_000_000_000, 50_000_000, 4
    full = zo.plan(psi, num_gpus=n, gpu_memory=24e9, host_memory=128e9)
    lora = zo.plan(psi, num_gpus=n, gpu_memory=24e9, host_memory=128e9, trainable_params=pt)
    assert full.kwargs["stage"] == 3 and full.kwargs["offload_optimizer"] == "nvme"
    assert lora.kwargs == {
        "stage": 3,
        "offload_optimizer": "none",
        "offload_param": "none",
        "dtype": "bfloat16",
        "prefetch_depth": 2,
    }
    assert all(
        not c.fits and "only stage 3 shards them" in c.reasons[0]
        for c in lora.candidates
        if c.stage < 3
    )
    # Per GPU: bf16 param shard 2Ψ/N, bf16 grad shard + fp32 master, m, v 14Ψt/N; in
    # forward/backward 3 gathered modules (Ψ/50 each, no model given) and 3 reductions in
    # flight of the largest trainable unit (at most Ψt); in initialize, the largest unit being
    # made (its fp32 values, its bf16 copy, an fp32 shard; Adam's m, v and the bf16 grad
    # shard, 10Ψt/N, come only later), the larger here.
    e = lora.choice.estimate
    largest = psi // 50
    assert e.gpu_bytes == 2 * psi // n + 14 * pt // n + max(
        3 * 2 * largest + 3 * 2 * pt, 6 * largest + 4 * (largest // n) - 10 * pt // n
    )
    assert e.gpu_bytes < 10e9 and e.host_bytes_per_node == 0 and e.nvme_bytes_per_node == 0
    f = full.choice.estimate
    # host: per rank the fp32 gradient shard (13 GB), small buffers sized to the sub-group,
    # and the sub-groups of optimizer state that the rest of the usable host memory
    # holds (the plan gives it to the optimizer); the 156 GB of state are split between them
    host_part = sum(t.bytes for t in f.terms if t.name == "optimizer state (host part)")
    assert 100e9 < f.host_bytes_per_node <= 0.9 * 128e9 and host_part > 0
    # on disk, besides: while a backward steps sub-groups in files, their new state and
    # values stand beside the old until step() (step_during_backward)
    beside = sum(t.bytes for t in f.terms if t.name.endswith("stepped in backward"))
    assert beside == 14 * (12 * psi // n - host_part) // 12
    assert f.nvme_bytes_per_node - n * beside + n * host_part == 12 * psi
    assert "13.00B params (50.0M trainable)" in lora.explanation
    assert "trainable_params" in lora.explanation and "trainable" not in full.explanation
    # Stage 3 with the optimizer on the host: 12Ψt/N of state, 2Ψt/N of bf16 gradients and
    # 2Ψt/N of CPU Adam output -> 16Ψt/N of host memory per rank, plus
    # 3 pinned staging buffers of the largest trainable unit's shard (at most Ψt/N) in bf16.
    host = next(
        c
        for c in lora.candidates
        if (c.stage, c.offload_optimizer, c.offload_param) == (3, "cpu", "none")
    )
    assert host.fits and host.estimate.host_bytes_per_node == n * (16 * pt // n + 3 * 2 * pt // n)


def test_plan_prefers_least_offload():
    p = zo.plan(50e6, num_gpus=2, gpu_memory=24e9, host_memory=64e9)
    assert p.kwargs == {
        "stage": 0,
        "offload_optimizer": "none",
        "offload_param": "none",
        "dtype": "bfloat16",
    }
    # Candidates are listed from least to most offloaded.
    assert [c.stage for c in p.candidates][:4] == [0, 1, 2, 3]


def test_plan_with_enough_host_memory_keeps_nvme_out():
    p = zo.plan(13e9, num_gpus=4, gpu_memory=24e9, host_memory=512e9, nvme_bytes=0)
    assert p.kwargs["stage"] == 3 and p.kwargs["offload_optimizer"] == "cpu"


def test_plan_nothing_fits_says_why_and_what_would():
    p = zo.plan(13e9, num_gpus=4, gpu_memory=24e9, host_memory=64e9, nvme_bytes=0)
    assert not p.fits and p.kwargs == {} and p.choice is None
    assert "nothing fits" in p.explanation
    assert "host memory per node >=" in p.explanation and "GPUs" in p.explanation


def test_plan_measures_nvme_path(monkeypatch, tmp_path):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(planner.shutil, "disk_usage", lambda path: usage(0, 0, 10**12))
    p = zo.plan(13e9, num_gpus=4, gpu_memory=24e9, host_memory=128e9, nvme_path=tmp_path)
    assert p.nvme_bytes == 10**12
    assert p.kwargs["offload_optimizer"] == "nvme" and p.kwargs["nvme_path"] == str(tmp_path)
    monkeypatch.setattr(planner.shutil, "disk_usage", lambda path: usage(0, 0, 10**9))
    p = zo.plan(13e9, num_gpus=4, gpu_memory=24e9, host_memory=128e9, nvme_path=tmp_path)
    assert not p.fits and "NVMe space per node >=" in p.explanation


def test_activations_count_when_given():
    act = planner.activation_memory(seq=2048, batch=1, width=5120, layers=40)
    assert act == 2 * 2048 * 5120 * 40 * 2
    with_act = zo.plan(13e9, num_gpus=4, gpu_memory=24e9, host_memory=128e9, activation_bytes=act)
    assert with_act.choice.estimate.activation_bytes == act
    assert not any("activations are not included" in n for n in with_act.notes)
    # Activations beyond the GPU: nothing fits, and the reason names them.
    p = zo.plan(13e9, num_gpus=4, gpu_memory=24e9, host_memory=128e9, activation_bytes=30e9)
    assert not p.fits and "activations" in p.candidates[-1].reasons[0]


# -- the command ---------------------------------------------------------------------------
def test_parse_sizes_and_counts():
    assert parse_size("24GB") == 24 * 10**9 and parse_size("24GiB") == 24 * 2**30
    # a bare letter is binary in every command (plan read "24G" as 24e9, bench io as 24 GiB)
    assert parse_size("24G") == parse_size("24GiB") and parse_size("512M") == 512 * 2**20
    assert bench_io.parse_size is plan_cli.parse_size is parse_size
    assert parse_size("512") == 512 and parse_size("1.5TB") == 1_500_000_000_000
    assert parse_count("13e9") == 13 * 10**9 and parse_count("6.7B") == 6_700_000_000
    assert parse_count("350M") == 350 * 10**6


def test_cli_table(capsys):
    rc = cli_main(
        [
            "plan",
            "--params",
            "13e9",
            "--gpus",
            "4",
            "--gpu-memory",
            "24GB",
            "--host-memory",
            "128GB",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "<- recommended" in out and "zo.initialize(model, stage=3" in out
    assert out.count("\n    ") >= 14  # a row per stage × offload choice


def test_cli_trainable_params(capsys):
    args = [
        "plan",
        "--params",
        "13e9",
        "--gpus",
        "4",
        "--gpu-memory",
        "24GB",
        "--host-memory",
        "128GB",
    ]
    rc = cli_main(args + ["--trainable-params", "50e6"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("13.00B params (50.0M trainable), 4 GPUs")
    assert "zo.initialize(model, stage=3, offload_optimizer='none', offload_param='none'" in out
    assert "12Ψt/N" in out
    rc = cli_main(["plan", "--preset", "13b", *args[3:], "--trainable-params", "50e6"])
    assert rc == 2 and "goes with --params" in capsys.readouterr().err


def test_cli_json_and_nvme(capsys, tmp_path):
    rc = cli_main(
        [
            "plan",
            "--preset",
            "13b",
            "--gpus",
            "4",
            "--gpu-memory",
            "24GB",
            "--host-memory",
            "128GB",
            "--nvme",
            str(tmp_path),
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert data["nvme_bytes"] > 0 and len(data["candidates"]) == len(planner.CHOICES)
    assert rc == (0 if data["fits"] else 1)
    if data["fits"] and "nvme" in (
        data["kwargs"]["offload_optimizer"],
        data["kwargs"]["offload_param"],
    ):
        assert data["kwargs"]["nvme_path"] == str(tmp_path)


def test_cli_nothing_fits_exit_code(capsys):
    rc = cli_main(
        [
            "plan",
            "--params",
            "70B",
            "--gpus",
            "1",
            "--gpu-memory",
            "8GB",
            "--host-memory",
            "16GB",
            "--nvme-bytes",
            "0",
        ]
    )
    assert rc == 1 and "nothing fits" in capsys.readouterr().out


def test_model_state_terms_are_labelled():
    e = zo.estimate_memory(1e9, num_gpus=8, stage=2, offload_optimizer="cpu")
    names = {t.name for t in e.terms if t.kind == MODEL_STATE and t.phase == RESIDENT}
    assert names == {"params", "grad shard", "optimizer state"}
