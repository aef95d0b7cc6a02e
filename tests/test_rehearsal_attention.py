"""The rehearsal counts attention as a GPU runs it: SDPA takes the fused kernel a GPU would
pick (no s² scores), the math path only when asked or when a GPU would fall back to it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import zero_offload as zo
from zero_offload.cli import main
from zero_offload.rehearsal.attention import GpuAttention, choose_kernel, kernel_scratch
from zero_offload.rehearsal.tracker import MemoryTracker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _qkv(dtype=torch.bfloat16, b=1, h=4, s=256, d=64, hk=None, grad=True):
    shape = (b, h, s, d)
    kv = (b, hk or h, s, d)
    return (
        torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad),
        torch.empty(kv, dtype=dtype, device="meta", requires_grad=grad),
        torch.empty(kv, dtype=dtype, device="meta", requires_grad=grad),
    )


def test_kernel_choice_follows_torch_on_a_gpu():
    """flash for bf16/fp16 without a mask; memory-efficient for a mask or fp32; the math
    path where neither can run (fp64, head dims that differ, an unaligned fp32 head dim)."""
    q, k, v = _qkv()
    assert choose_kernel(q, k, v, is_causal=True) == "flash"
    mask = torch.ones(256, 256, dtype=torch.bool, device="meta")
    assert choose_kernel(q, k, v, attn_mask=mask) == "efficient"
    assert choose_kernel(*_qkv(torch.float32)) == "efficient"
    assert choose_kernel(*_qkv(torch.float64)) == "math"
    assert choose_kernel(*_qkv(torch.float32, d=62)) == "math"
    # sm86/sm89 cannot train flash with head dims in (192, 224]
    assert choose_kernel(*_qkv(d=200)) == "efficient"
    assert choose_kernel(*_qkv(d=200, grad=False)) == "flash"
    # grouped-query attention: flash with enable_gqa, else the heads must match
    q, k, v = _qkv(hk=2)
    assert choose_kernel(q, k, v, is_causal=True, enable_gqa=True) == "flash"
    assert choose_kernel(q, k, v, is_causal=True) == "math"


def _attention_peak(kernel: str, s: int) -> tuple[int, dict]:
    """Device peak of one causal attention's forward and backward on the simulated GPU."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker("meta", scratch=kernel_scratch)
        attn = GpuAttention(kernel)
        with attn, tracker:
            tracker.begin("forward")
            q, k, v = _qkv(s=s)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            tracker.end()
            tracker.begin("backward")
            out.sum().backward()
            tracker.end()
    return max(p.device_peak for p in tracker.phases.values()), dict(attn.calls)


def test_fused_attention_memory_is_linear_in_the_sequence():
    """At 4× the tokens the math path's peak grows ~16× (its s² scores), flash's 4×; flash's
    peak is q, k, v, their gradients, the output and its gradient, plus the kernel's fp32
    dQ accumulator and row statistics."""
    flash_1, calls = _attention_peak("auto", 512)
    flash_4, _ = _attention_peak("auto", 2048)
    math_1, _ = _attention_peak("math", 512)
    math_4, math_calls = _attention_peak("math", 2048)
    assert calls == {"flash": 1} and math_calls == {"math": 1}
    assert 3.5 < flash_4 / flash_1 < 4.5
    assert math_4 / math_1 > 10
    s, h, d = 2048, 4, 64
    qkv = 3 * h * s * d * 2
    # forward: q, k, v, out, lse; backward adds grad out, dq, dk, dv and the scratch
    scratch = 4 * h * s * (1 + d)
    assert flash_4 <= 2 * qkv + 2 * h * s * d * 2 + 4 * h * s + scratch
    assert flash_4 >= qkv + scratch
    assert math_4 > 2 * h * s * s  # at least one bf16 score matrix


def _llama_folder(path) -> str:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_rehearsal_of_a_named_model_runs_fused_attention(tmp_path, capsys):
    """A Hugging Face Llama built by name runs SDPA (as HF does on a GPU), which the
    rehearsal runs as flash attention; ``attention="math"`` counts the s² path. The report
    says which was assumed."""
    pytest.importorskip("transformers")
    folder = _llama_folder(tmp_path)
    fused = zo.rehearse(
        folder,
        world_size=1,
        gpu_memory=10**10,
        micro_batch=(1, 1024),
        checkpointing=True,
        stage=3,
        dtype="bfloat16",
        iterations=1,
    )
    assert set(fused.attention_calls) == {"flash"} and "flash" in str(fused)
    rc = main(
        ["rehearse", "--model", folder, "--gpus", "1", "--gpu-memory", "10GB", "--stage", "3"]
        + [
            "--micro-batch",
            "1x1024",
            "--checkpointing",
            "--attention",
            "math",
            "--iterations",
            "1",
            "--json",
        ]
    )
    math = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(math["attention_calls"]) == {"math"}, math["attention"]
    assert "math" in math["attention"]
    # the math path keeps heads × s² scores (4 × 1024² × 4 bytes in fp32: 16.8 MB)
    assert math["activation_bytes"] > fused.activation_bytes + 4 * 1024 * 1024 * 2
