"""The rehearsal: the engine's own initialize/forward/backward/step on a simulated GPU (fake
tensors, fake process group), its allocations counted, set against estimate_memory."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import zero_offload as zo
from zero_offload.bench.gpt import GPT, Block, GPTConfig
from zero_offload.cli import main
from zero_offload.device import placement
from zero_offload.rehearsal.tracker import ACTIVATIONS, GATHERED, OPTIMIZER, PARAMS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CFG = GPTConfig(layers=4, width=128, heads=4, vocab=512, seq=64)
SEQS = 8  # activations dominate, as in the runs this models
CHOICES = [
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (3, "none", "none"),
    (1, "cpu", "none"),
    (2, "cpu", "none"),
    (3, "cpu", "none"),
    (3, "none", "cpu"),
    (3, "cpu", "cpu"),
]


def meta_gpt(cfg: GPTConfig = CFG) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def tokens(seqs: int = SEQS, cfg: GPTConfig = CFG):
    return lambda: (torch.zeros(seqs, cfg.seq, dtype=torch.long),) * 2


def kwargs(stage: int, opt: str, par: str) -> dict:
    # buckets of 50K elements: several units per model, as 25M-element buckets are in a 7B
    kw = dict(stage=stage, offload_optimizer=opt, dtype=torch.bfloat16, reduce_bucket_size=50_000)
    if stage == 3:
        kw["offload_param"] = par
    return kw


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: "-".join(map(str, c)))
def test_measured_peak_agrees_with_estimate(world, choice):
    """Each stage × offload at 1, 2 and 4 ranks: the device peak the engine's code allocates
    is what estimate_memory says (given the measured activations) within 10%; what stays
    allocated after a step is the estimate's resident figure (the ledger) to the byte, but
    for the optimizer's step counter."""
    r = zo.rehearse(
        meta_gpt(), world_size=world, gpu_memory=10**9, batch=tokens(), **kwargs(*choice)
    )
    assert r.failure is None and r.device_clean, (r.failure, r.problems)
    assert abs(r.estimate_error) <= 0.10, str(r)
    est, meas = r.estimated_phase_bytes(), r.measured_phase_bytes()
    # the estimate leaves out the step's flag exchange: 8 bytes per parameter tensor
    flags = 8 * (sum(1 for _ in meta_gpt().parameters()) + 64)
    for phase in ("forward/backward", "step"):
        assert abs(est[phase] - meas[phase]) <= 0.10 * meas[phase] + flags, (phase, str(r))
    resident = r.estimate.resident_bytes("device")
    assert 0 <= r.phases["step"].device_end - resident <= 4, str(r)
    assert r.activation_bytes > 0 and r.fits


def test_whole_model_moved_to_device_is_caught(monkeypatch):
    """A stage-3 engine that moves the whole model to the GPU in initialize (the model built
    on the CPU, as from_pretrained does) peaks at the whole model: the rehearsal sees it,
    where the same model from the meta device stays near the estimate."""
    cfg = GPTConfig(layers=4, width=256, heads=4, vocab=1024, seq=64)
    one = tokens(1, cfg)
    clean = zo.rehearse(
        meta_gpt(cfg), world_size=4, gpu_memory=10**9, batch=one, **kwargs(3, "cpu", "none")
    )
    monkeypatch.setattr(placement, "move_model", lambda model, device, stage: model.to(device))
    whole = 4 * clean.num_params  # the fp32 model
    planted = zo.rehearse(
        GPT(cfg), world_size=4, gpu_memory=10**9, batch=one, **kwargs(3, "cpu", "none")
    )
    assert clean.phases["initialize"].device_peak < whole / 2
    assert planted.phases["initialize"].device_peak >= whole
    est, meas = planted.estimated_phase_bytes(), planted.measured_phase_bytes()
    assert meas["initialize"] > 2 * est["initialize"]  # far above the planner: flagged
    assert planted.estimate_error < -0.3
    assert "initialize" in str(planted) and planted.peak_phase == "initialize"
    # on a GPU that the clean run fits, the planted one does not
    gpu = int(clean.peak_bytes / 0.9) + 1
    assert zo.rehearse(
        meta_gpt(cfg), world_size=4, gpu_memory=gpu, batch=one, **kwargs(3, "cpu", "none")
    ).fits
    planted = zo.rehearse(
        GPT(cfg), world_size=4, gpu_memory=gpu, batch=one, **kwargs(3, "cpu", "none")
    )
    assert not planted.fits and "DOES NOT FIT" in planted.verdict()


class StrayCopyBlock(Block):
    """A block that keeps a copy of its gathered fc weight on the device: a stray copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stray = self.fc.weight.detach().clone()
        return super().forward(x)


def test_stray_copy_in_the_last_of_identical_units_is_caught():
    """Eight identical checkpointed blocks at stage 3: a stray device copy planted in the
    last one only raises the measured peak by at least its size. Every unit runs through the
    tracker; none is extrapolated from the first."""
    cfg = GPTConfig(layers=8, width=256, heads=4, vocab=512, seq=64, checkpoint=True)
    one = tokens(2, cfg)
    clean = zo.rehearse(
        meta_gpt(cfg), world_size=4, gpu_memory=10**9, batch=one, **kwargs(3, "cpu", "none")
    )
    planted_model = meta_gpt(cfg)
    planted_model.blocks[-1].__class__ = StrayCopyBlock
    planted = zo.rehearse(
        planted_model, world_size=4, gpu_memory=10**9, batch=one, **kwargs(3, "cpu", "none")
    )
    stray = 2 * 4 * cfg.width * cfg.width  # bf16 fc weight, gathered whole
    assert planted.failure is None and clean.failure is None
    assert planted.peak_bytes >= clean.peak_bytes + stray, (str(clean), str(planted))
    for phase in ("backward", "step"):
        assert planted.phases[phase].device_end >= clean.phases[phase].device_end + stray


def test_activations_are_measured_and_feed_the_planner():
    """Activations grow with the micro-batch, shrink with checkpointing, and the planner given
    the measured figure (activation_bytes) predicts the measured peak within 10%. (The
    estimate holds the activations, the gathered window and the reductions in flight at
    once; the micro-batches are large enough that activations dominate, as at long context:
    attention runs as a GPU's fused kernel, without s² scores.)"""
    small = zo.rehearse(
        meta_gpt(),
        world_size=2,
        gpu_memory=10**9,
        batch=tokens(2 * SEQS),
        **kwargs(3, "cpu", "none"),
    )
    large = zo.rehearse(
        meta_gpt(),
        world_size=2,
        gpu_memory=10**9,
        batch=tokens(4 * SEQS),
        **kwargs(3, "cpu", "none"),
    )
    ckpt_cfg = GPTConfig(layers=4, width=128, heads=4, vocab=512, seq=64, checkpoint=True)
    ckpt = zo.rehearse(
        meta_gpt(ckpt_cfg),
        world_size=2,
        gpu_memory=10**9,
        batch=tokens(4 * SEQS),
        **kwargs(3, "cpu", "none"),
    )
    assert 1.8 < large.activation_bytes / small.activation_bytes < 2.2
    assert ckpt.activation_bytes < 0.7 * large.activation_bytes
    for r in (small, large, ckpt):
        assert r.phases["backward"].device_kinds[ACTIVATIONS] > 0
        p = zo.plan(
            meta_gpt(),
            num_gpus=2,
            gpu_memory=10**9,
            host_memory=10**10,
            activation_bytes=r.activation_bytes,
        )
        c = next(
            c
            for c in p.candidates
            if (c.stage, c.offload_optimizer, c.offload_param) == (3, "cpu", "none")
        )
        assert abs(c.estimate.gpu_bytes - r.peak_bytes) <= 0.10 * r.peak_bytes


def test_breakdown_by_kind_and_tier():
    """Stage 3, optimizer on the host, parameters on the GPU: the GPU holds the parameter
    shards between steps, gathers units in forward/backward and holds no optimizer state;
    the host holds the fp32 state (fake host tensors, counted)."""
    r = zo.rehearse(
        meta_gpt(), world_size=2, gpu_memory=10**9, batch=tokens(), **kwargs(3, "cpu", "none")
    )
    shard = 2 * r.estimate.shard_numel
    assert r.phases["step"].device_kinds.get(PARAMS) == shard
    assert OPTIMIZER not in r.phases["step"].device_kinds
    assert r.phases["step"].host_kinds.get(OPTIMIZER, 0) >= 12 * r.estimate.shard_numel
    assert r.phases["forward"].h2d_bytes > 0 or r.phases["backward"].d2h_bytes > 0
    assert (
        any(m.device_kinds.get(GATHERED, 0) for m in r.phases.values())
        or r.phases["backward"].device_peak > shard
    )


class MixesDevices(nn.Module):
    """A forward that adds a host tensor to a device one: a device-unclean model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.ones(16)


def test_host_device_mix_is_reported():
    with torch.device("meta"):
        model = MixesDevices()
    r = zo.rehearse(
        model, world_size=1, gpu_memory=10**9, batch=lambda: torch.zeros(2, 16), stage=2
    )
    assert not r.fits and not r.device_clean
    assert r.failure.startswith("forward") and "mixed host and device" in r.problems[0]
    assert "NOT DEVICE-CLEAN" in r.verdict()


def test_model_larger_than_this_machine_allocates_nothing():
    """A 12B-parameter stack (48 GB in fp32, more than this machine's RAM) rehearses at stage 3
    with the optimizer on the host (192 GB of host state, simulated) without allocating it."""
    import resource

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(20_000, 20_000, bias=False) for _ in range(30)])
    r = zo.rehearse(
        model,
        world_size=4,
        gpu_memory=80 * 10**9,
        batch=lambda: torch.zeros(4, 20_000),
        iterations=1,
        **kwargs(3, "cpu", "none"),
    )
    assert r.failure is None and r.fits
    assert r.phases["step"].host_peak > 12 * 12e9 / 4  # fp32 master, m, v of a quarter
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 6 * 2**30
    assert abs(r.estimate_error) <= 0.10


@pytest.mark.parametrize(
    "choice",
    [(2, "nvme", "none"), (3, "nvme", "nvme"), (3, "cpu", "nvme")],
    ids=lambda c: "-".join(map(str, c)),
)
def test_nvme_tier_is_simulated(tmp_path, choice):
    """The NVMe tier runs the engine's own swap code on a simulated disk: the files' sizes
    are what estimate_memory puts on NVMe per rank (to 4 KiB alignment per file), the step
    reads and writes them, the host holds the pipeline buffers the estimate says, the GPU
    peak agrees with the estimate, and nothing is written to nvme_path (which need not
    exist on this machine)."""
    nvme_path = tmp_path / "not-here"
    r = zo.rehearse(
        meta_gpt(),
        world_size=2,
        gpu_memory=10**9,
        batch=tokens(),
        nvme_path=str(nvme_path),
        host_memory=8 * 10**9,
        **kwargs(*choice),
    )
    assert r.failure is None and r.device_clean, (r.failure, r.problems)
    assert r.nvme_simulated and not nvme_path.exists()
    nvme = max(m.nvme_peak for m in r.phases.values())
    est = r.estimate.nvme_bytes_per_rank
    assert est > 0 and abs(nvme - est) <= 0.05 * est, str(r)
    host = max(m.host_peak for m in r.phases.values())
    assert abs(host - r.estimate.host_bytes_per_rank) <= 0.10 * host, str(r)
    step = r.phases["step"]
    assert step.nvme_written > 0
    if choice[1] == "nvme":  # the optimizer state is read back and written in every step
        assert step.nvme_read >= 12 * r.estimate.trainable_shard_numel
    else:  # the parameter shards are read in every forward
        assert r.phases["forward"].nvme_read >= 2 * r.estimate.shard_numel
    assert abs(r.estimate_error) <= 0.10, str(r)
    out = str(r)
    assert "NVMe peak" in out and "NVMe (per rank)" in out
    assert "simulated: the engine's swap code" in out and r.to_dict()["tiers"]["NVMe"]


def test_simulated_disk_refuses_what_was_never_written():
    """A read of bytes no write put there fails, as a real file would come up short; a full
    disk refuses the write that does not fit."""
    from zero_offload.errors import SwapIOError
    from zero_offload.rehearsal.disk import SimulatedDisk

    disk = SimulatedDisk(capacity=8192)
    files = disk.io_engine()
    buf = torch.empty(4096, dtype=torch.uint8)
    files.write("a", buf).result()
    files.read("a", buf).result()
    with pytest.raises(SwapIOError, match="past what was written"):
        files.read("a", buf, offset=4096).result()
    files.write("a", buf, offset=4096).result()
    assert disk.live == disk.peak == 8192 and disk.written == 8192 and disk.read == 4096
    with pytest.raises(SwapIOError, match="full"):
        files.write("b", buf).result()
    files.close()
    assert disk.live == 0 and disk.peak == 8192


def test_misses_say_what_to_change():
    r = zo.rehearse(
        meta_gpt(),
        world_size=2,
        gpu_memory=5 * 10**6,
        micro_batch=None,
        batch=tokens(),
        **kwargs(2, "none", "none"),
    )
    assert not r.fits and "DOES NOT FIT" in r.verdict()
    assert any("checkpointing" in s for s in r.suggestions())


def test_cli_on_a_config_folder(tmp_path, capsys):
    """``zero-offload rehearse`` on a Hugging Face config.json: the planner picks the
    configuration, the rehearsal runs it and prints the verdict (exit 0: it fits)."""
    pytest.importorskip("transformers")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc = main(
        [
            "rehearse",
            "--model",
            str(tmp_path),
            "--gpus",
            "2",
            "--gpu-memory",
            "1GB",
            "--host-memory",
            "8GB",
            "--micro-batch",
            "2x64",
            "--checkpointing",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verdict: FITS" in out and "device-clean: yes" in out and "simulated" in out
    rc = main(
        [
            "rehearse",
            "--model",
            str(tmp_path),
            "--gpus",
            "1",
            "--gpu-memory",
            "1MB",
            "--stage",
            "2",
            "--micro-batch",
            "2x64",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and not report["fits"] and report["peak_bytes"] > 10**6
    assert (
        main(
            [
                "rehearse",
                "--model",
                "llama-1t",
                "--gpus",
                "1",
                "--gpu-memory",
                "1GB",
                "--stage",
                "3",
            ]
        )
        == 2
    )
    # the NVMe tier, simulated: a disk of the given size per node, shared by its ranks
    nvme = [
        "rehearse",
        "--model",
        str(tmp_path),
        "--gpus",
        "2",
        "--gpu-memory",
        "1GB",
        "--host-memory",
        "8GB",
        "--stage",
        "3",
        "--offload-optimizer",
        "nvme",
        "--micro-batch",
        "2x64",
    ]
    assert main(nvme + ["--nvme-bytes", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "NVMe peak" in out and "NVMe         simulated" in out
    assert main(nvme + ["--nvme-bytes", "1MB", "--json"]) == 1  # 12 bytes/param do not fit
    report = json.loads(capsys.readouterr().out)
    assert report["failure"].startswith("initialize: SwapSpaceError"), report["failure"]
