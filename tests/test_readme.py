"""The README's trainer and DeepSpeed sections are copy-pasteable: each code block runs as
written (in a fresh process, in a temporary folder) and does what the text says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def blocks(section: str, lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(rf"```{lang}\n(.*?)```", text[start:end], re.S)


def run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res.stdout


def test_coming_from_deepspeed(tmp_path):
    (code,) = blocks("Coming from DeepSpeed", "python")
    run([sys.executable, "-c", code], tmp_path)
    (command,) = blocks("Coming from DeepSpeed", "bash")
    args = command.split("#")[0].split()
    assert args[:2] == ["zero-offload", "convert-config"]
    out = run([sys.executable, "-m", "zero_offload.cli", *args[1:]], tmp_path)
    assert "stage=2" in out and "offload_optimizer='cpu'" in out and "max_grad_norm=1.0" in out


def test_use_with_hugging_face_trainer(tmp_path):
    pytest.importorskip("transformers")
    (code,) = blocks("Use with Hugging Face Trainer", "python")
    run([sys.executable, "-c", code], tmp_path)
    final = tmp_path / "out" / "final"
    assert (final / "model.safetensors").exists() and (final / "config.json").exists()
    assert (tmp_path / "out" / "checkpoint-2" / "zero_offload" / "latest").exists()


def test_use_with_lightning(tmp_path):
    pytest.importorskip("lightning")
    code = "\n".join(blocks("Use with Lightning", "python"))  # the second goes on from the first
    run([sys.executable, "-c", code], tmp_path)
    ckpt = tmp_path / "regressor.ckpt"
    assert (ckpt / "lightning.pt").exists() and (ckpt / "latest").exists()
