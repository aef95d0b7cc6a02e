"""The planner's activation estimate against the rehearsal, and the measures the planner picks.

The rehearsal runs on fake tensors: a decoder as wide as Llama 2 13B at 128k tokens costs the
same as at 2k (its time is per operation), so the points below are the real widths and
sequence lengths at two to four layers."""

from __future__ import annotations

import json

import pytest
import torch

import zero_offload as zo
from zero_offload.activations.config import ActivationConfig
from zero_offload.bench.gpt import GPT, GPTConfig
from zero_offload.cli import main
from zero_offload.planning.estimate.activations import DecoderShape, estimate_activations
from zero_offload.planning.search.measures import Measures, ladder

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LLAMA_13B = dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40)


def _llama(path, layers: int) -> str:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "num_key_value_heads": 40,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        **LLAMA_13B,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "layers, seq, checkpointing, offload, tiles",
    [
        (2, 2048, False, None, 0),
        (2, 2048, True, "checkpoints", 0),
        (2, 8192, True, None, 0),
        (2, 16384, False, None, 4096),
        (2, 16384, True, None, 4096),
        (4, 32768, True, "checkpoints", 0),
        (4, 32768, True, "checkpoints", 4096),
        (2, 131072, False, None, 4096),
        (2, 131072, True, None, 0),
        (4, 131072, True, "checkpoints", 4096),
    ],
    ids=[
        "2k",
        "2k-ckpt-offload",
        "8k-ckpt",
        "16k-tiled",
        "16k-ckpt-tiled",
        "32k-ckpt-offload",
        "32k-ckpt-offload-tiled",
        "128k-tiled",
        "128k-ckpt",
        "128k-ckpt-offload-tiled",
    ],
)
def test_planned_activations_agree_with_the_rehearsal(
    tmp_path, layers, seq, checkpointing, offload, tiles
):
    """Llama 2 13B's widths at 2k to 128k tokens, with and without checkpointing, activation
    offload and the tiled loss: the planner's activations are the rehearsal's within 10% (the
    largest at any of its phases' successive peaks), and so is the forward/backward peak
    wherever the activations dominate it (at 2 layers and 2k the engine's gathered window
    and reductions in flight, which the estimate holds at once, are as large)."""
    pytest.importorskip("transformers")
    kwargs = {"offload_activations": offload} if offload else {}
    if tiles:
        kwargs["tiled_loss"] = tiles
    r = zo.rehearse(
        _llama(tmp_path, layers),
        world_size=4,
        gpu_memory=10**12,
        micro_batch=(1, seq),
        checkpointing=checkpointing,
        stage=3,
        offload_optimizer="cpu",
        dtype="bfloat16",
        iterations=1,
        **kwargs,
    )
    assert r.failure is None, r.failure
    planned = r.planned_activations
    assert planned is not None and planned.offload == bool(offload)
    assert planned.tile_tokens == tiles
    assert abs(planned.device_bytes - r.activations_peak) <= 0.10 * r.activations_peak
    if seq >= 8192:
        assert r.planned_error is not None and abs(r.planned_error) <= 0.10, str(r)
    if offload:  # every layer's input in a host buffer: the host holds what was planned
        host = max(p.host_peak for p in r.phases.values())
        # and, with the tiled loss, its tiles' input (the last hidden states)
        assert planned.host >= (layers + bool(tiles)) * seq * 5120 * 2
        assert abs(host - r.planned_estimate.host_bytes_per_rank) <= 0.01 * host


def test_planned_activations_of_the_benchmark_gpt():
    """The benchmark GPT (LayerNorm, 4h GELU MLP, tied head) at 16k tokens, checkpointed."""
    cfg = GPTConfig(layers=2, width=2048, heads=16, vocab=32000, seq=16384, checkpoint=True)
    with torch.device("meta"):
        model = GPT(cfg)
    r = zo.rehearse(
        model,
        world_size=4,
        gpu_memory=10**12,
        micro_batch=(1, cfg.seq),
        batch=lambda: (torch.zeros(1, cfg.seq, dtype=torch.long),) * 2,
        checkpointing=True,
        stage=3,
        offload_optimizer="cpu",
        dtype="bfloat16",
        iterations=1,
    )
    planned = r.planned_activations
    assert planned is not None
    assert abs(planned.device_bytes - r.activations_peak) <= 0.10 * r.activations_peak
    assert r.planned_error is not None and abs(r.planned_error) <= 0.10


def test_measures_are_tried_from_the_cheapest():
    assert ladder(32768) == (
        Measures(),
        Measures(tile_tokens=4096),
        Measures(checkpointing=True),
        Measures(checkpointing=True, tile_tokens=4096),
        Measures(checkpointing=True, offload=True),
        Measures(checkpointing=True, offload=True, tile_tokens=4096),
    )
    # a micro-batch no longer than a tile has nothing to tile; fixed measures stay fixed
    assert ladder(2048, checkpointing=True) == (
        Measures(checkpointing=True),
        Measures(checkpointing=True, offload=True),
    )
    with pytest.raises(ValueError, match="needs checkpointing"):
        ladder(8192, checkpointing=False, offload=True)


def _llama_13b():
    pytest.importorskip("transformers")
    from zero_offload.rehearsal.models import build_model

    return build_model("llama-13b")


def test_plan_picks_what_the_activations_need():
    """13B on 4 × 24 GB: at 8k checkpointing is enough; at 32k it takes activation offload
    too, and the plan says the cheaper measures do not fit; fixing them leaves nothing."""
    model = _llama_13b()
    kw = dict(num_gpus=4, gpu_memory=24 * 10**9, host_memory=512 * 10**9)
    p8 = zo.plan(model, micro_batch=(1, 8192), **kw)
    assert p8.fits and p8.choice.measures == Measures(checkpointing=True)
    assert "offload_activations" not in p8.kwargs
    p32 = zo.plan(model, micro_batch=(1, 32768), **kw)
    assert p32.fits and p32.choice.measures.offload and p32.choice.measures.checkpointing
    assert p32.kwargs["offload_activations"] == "checkpoints"
    assert "which does not fit" in p32.explanation
    assert p32.choice.estimate.gpu_bytes <= 0.9 * 24 * 10**9
    assert all(gpu > 0.9 * 24 * 10**9 for _, gpu in p32.choice.cheaper)
    fixed = zo.plan(model, micro_batch=(1, 32768), offload_activations=False, **kw)
    assert not fixed.fits
    # the activations of a parameter count are unknown: say what to give instead
    with pytest.raises(ValueError, match="activation_bytes"):
        zo.plan(13e9, micro_batch=(1, 8192), **kw)
    # the estimate's parts: offload keeps two inputs on the GPU, the rest in host buffers
    shape = DecoderShape.of(model)
    assert shape == DecoderShape(40, 5120, 13824, 40, 40, 128, 32000, "llama")
    on = estimate_activations(
        shape,
        batch=1,
        seq=32768,
        checkpointing=True,
        activations=ActivationConfig(mode="checkpoints"),
    )
    off = estimate_activations(shape, batch=1, seq=32768, checkpointing=True)
    inputs = 32768 * 5120 * 2
    assert off.moments["backward: the loss"] - on.moments["backward: the loss"] == 38 * inputs
    assert on.host >= 40 * inputs


def test_plan_cli_takes_the_micro_batch(capsys):
    pytest.importorskip("transformers")
    args = ["plan", "--model", "llama-13b", "--gpus", "4", "--gpu-memory", "24GB"]
    assert main(args + ["--micro-batch", "1x32768"]) == 0
    out = capsys.readouterr().out
    assert "ckpt+offload" in out and "offload_activations='checkpoints'" in out
    assert "gradient_checkpointing_enable()" in out and "host not checked" in out
    assert main(args + ["--seq-len", "8192", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kwargs"].get("offload_activations") is None
    assert main(args + ["--micro-batch", "2"]) == 2  # sequences of how many tokens?
    assert "--seq-len" in capsys.readouterr().err
    assert main(["plan", "--params", "13e9", "--gpus", "4", "--gpu-memory", "24GB"]
                + ["--checkpointing"]) == 2  # fmt: skip
