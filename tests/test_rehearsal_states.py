"""The rehearsal's host bytes for low-precision optimizer state against the estimate.

Llama 2 13B's widths on 4 × 24 GB GPUs at two layers (fake tensors: the per-layer bytes are
the real ones, the depth only multiplies them), stage 3 with the state in host memory, as
``zero-offload plan --allow-low-precision-states`` recommends for the full model."""

from __future__ import annotations

import json

import pytest

import zero_offload as zo
from zero_offload.cli import main
from zero_offload.rehearsal.run import rehearse

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SMALL_TENSORS = 1 << 20  # the norms' and step counts' few kB, beside 240M elements a rank


def _llama_13b_widths(path, layers: int = 2) -> str:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "num_hidden_layers": layers,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


STATES = [("8bit", "bf16_sr", 4.03), ("bf16", "fp32", 8.0)]


def _rehearse(path, moments: str, master: str):
    pytest.importorskip("transformers")
    return rehearse(
        _llama_13b_widths(path),
        world_size=4,
        gpu_memory=24 * 10**9,
        micro_batch=(1, 256),
        checkpointing=True,
        host_memory=128 * 10**9,
        iterations=1,
        stage=3,
        offload_optimizer="cpu",
        offload_param="none",
        dtype="bfloat16",
        moment_precision=moments,
        master_precision=master,
    )


@pytest.mark.parametrize("moments, master, per_param", STATES)
def test_host_bytes_of_the_state_are_the_estimates(tmp_path, moments, master, per_param):
    """After the step the host holds what ``estimate_memory`` (the plan's figures) counts
    for this state precision: master, moments (8-bit codes with their absmax), the
    compute-dtype output, the gradient shard and its staging buffers."""
    r = _rehearse(tmp_path, moments, master)
    assert r.failure is None, r.failure
    est = zo.estimate_memory(
        r.shape, **{**r.estimate_kwargs, "moment_precision": moments, "master_precision": master}
    )
    state = next(t for t in est.terms if t.name == "optimizer state" and t.tier == "host")
    assert state.bytes == pytest.approx(per_param * est.shard_numel, rel=2e-3)
    assert r.estimate.host_bytes_per_rank == est.host_bytes_per_rank
    held = r.phases["step"].host_end
    assert abs(held - est.host_bytes_per_rank) < SMALL_TENSORS, (held, est.host_bytes_per_rank)
    assert f"adamw, {moments} moments, {master} master" in str(r)
    gb, text = est.host_bytes_per_rank / 1e9, str(r)
    assert f"estimated {gb:>7.2f} GB, measured" in text
    assert f"{gb:.2f} GB after the step" in text


def test_the_first_step_allocates_only_the_state_it_keeps(tmp_path):
    r = _rehearse(tmp_path, "8bit", "bf16_sr")
    step = r.phases["step"]
    assert step.host_peak - step.host_end < SMALL_TENSORS


def test_cli_takes_the_state_precisions(tmp_path, capsys):
    """``rehearse --moment-precision/--master-precision`` reach the engine and the report."""
    rc = main(
        [
            "rehearse",
            "--model",
            _llama_13b_widths(tmp_path),
            "--gpus",
            "4",
            "--gpu-memory",
            "24GB",
            "--host-memory",
            "128GB",
            "--micro-batch",
            "1x256",
            "--checkpointing",
            "--iterations",
            "1",
            "--stage",
            "3",
            "--offload-optimizer",
            "cpu",
            "--moment-precision",
            "8bit",
            "--master-precision",
            "bf16_sr",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "moment_precision='8bit'" in out and "master_precision='bf16_sr'" in out
    line = next(x for x in out.splitlines() if x.startswith("  optimizer state:"))
    assert line == "  optimizer state: adamw, 8bit moments, bf16_sr master (4.03 B/param)"


def test_a_share_of_the_state_in_host_memory_is_estimated_there(tmp_path):
    """``offload_optimizer_fraction`` (what the plan picks for fp32 13B on 128 GB nodes)
    keeps some sub-groups' state in host memory: the estimate the rehearsal sets
    beside its counts splits the state the same way between the host and the disk."""
    pytest.importorskip("transformers")
    r = rehearse(
        _llama_13b_widths(tmp_path),
        world_size=4,
        gpu_memory=24 * 10**9,
        micro_batch=(1, 256),
        checkpointing=True,
        host_memory=128 * 10**9,
        iterations=1,
        stage=3,
        offload_optimizer="nvme",
        offload_param="none",
        offload_optimizer_fraction=0.5,
        dtype="bfloat16",
    )
    assert r.failure is None, r.failure
    nvme = max(m.nvme_peak for m in r.phases.values())
    est = r.estimate
    assert est.nvme_fraction == pytest.approx(0.5, abs=0.05)  # whole sub-groups
    assert abs(nvme - est.nvme_bytes_per_rank) <= 0.05 * nvme, (nvme, est.nvme_bytes_per_rank)
    held = r.phases["step"].host_end
    assert abs(held - est.host_bytes_per_rank) <= 0.05 * held, (held, est.host_bytes_per_rank)


def test_the_planner_takes_given_precisions():
    """Precisions given to ``plan`` are the only row it plans, and its keywords carry them."""
    p = zo.plan(
        13e9, num_gpus=4, gpu_memory=24 * 10**9, host_memory=128 * 10**9,
        moment_precision="8bit", master_precision="bf16_sr",
    )  # fmt: skip
    assert p.fits
    assert [r.policy.master.value for r in p.states] == ["bf16_sr"]
    assert p.kwargs["moment_precision"] == "8bit" and p.kwargs["master_precision"] == "bf16_sr"


def _tiny(path) -> list[str]:
    pytest.importorskip("transformers")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return ["rehearse", "--model", str(path), "--gpus", "2", "--gpu-memory", "1GB",
            "--micro-batch", "1x64"]  # fmt: skip


def test_rehearse_plans_for_the_given_precisions(tmp_path, capsys):
    """Without --stage the planner is told the precisions, so its choice runs."""
    rc = main(_tiny(tmp_path) + ["--moment-precision", "8bit", "--master-precision", "bf16_sr"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    assert "'moment_precision': '8bit'" in captured.err


def test_rehearse_passes_prefetch_depth_zero_to_the_planner(tmp_path, monkeypatch):
    from zero_offload.planning.search import planner

    seen = {}

    def fake_plan(model, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(planner, "plan", fake_plan)
    assert main(_tiny(tmp_path) + ["--prefetch-depth", "0"]) == 2
    assert seen["prefetch_depth"] == 0
