"""The README and the docs pages it leads to are copy-pasteable: the README's install and test
commands are what CI runs, its example and the trainer and DeepSpeed pages' code blocks run as
written (each in a fresh process, in a temporary folder) and do what the text says, and every
relative link in them names a file of the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def blocks(page: str, section: str, lang: str) -> list[str]:
    """The ``lang`` code blocks under the heading ``section`` (any level) of ``page``, up to
    the next heading of that level or above (``#`` lines inside code blocks are code)."""
    lines = (ROOT / page).read_text().splitlines(keepends=True)
    fenced, level, body = False, 0, []
    for line in lines:
        heading = re.match(r"(#+) (.*)\n", line) if not fenced else None
        if line.startswith("```"):
            fenced = not fenced
        if heading and level and len(heading.group(1)) <= level:
            break
        if heading and not level and heading.group(2) == section:
            level = len(heading.group(1))
        elif level:
            body.append(line)
    assert level, f"{page} has no section {section!r}"
    return re.findall(rf"```{lang}\n(.*?)```", "".join(body), re.S)


def run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res.stdout


def test_the_readme_commands_are_what_ci_runs():
    (commands,) = blocks("README.md", "Install and test", "bash")
    install, test = (line.split("#")[0].strip() for line in commands.strip().splitlines())
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    # .ci/run installs quietly and runs lint and type checks between the two
    installs = [c.replace("python -m ", "").replace(" -q", "") for c in ci if "pip install" in c]
    assert [c.strip() for c in install.split("&&")] == installs
    assert ci[-1] == test == "python -m pytest -q"


def test_the_readme_example(tmp_path):
    (code,) = blocks("README.md", "Example", "python")
    assert len(code.splitlines()) <= 16
    out = run([sys.executable, "-c", code], tmp_path)
    assert "optimizer" in out and "reduce_scatter" in out  # the memory report
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step4"  # 8 micro-steps / 2


def test_coming_from_deepspeed(tmp_path):
    (code,) = blocks("docs/deepspeed.md", "A first run", "python")
    run([sys.executable, "-c", code], tmp_path)
    (command,) = blocks("docs/deepspeed.md", "A first run", "bash")
    args = command.split("#")[0].split()
    assert args[:2] == ["zero-offload", "convert-config"]
    out = run([sys.executable, "-m", "zero_offload.cli", *args[1:]], tmp_path)
    assert "stage=2" in out and "offload_optimizer='cpu'" in out and "max_grad_norm=1.0" in out


def test_use_with_hugging_face_trainer(tmp_path):
    pytest.importorskip("transformers")
    (code,) = blocks("docs/trainers.md", "Hugging Face Trainer", "python")
    run([sys.executable, "-c", code], tmp_path)
    final = tmp_path / "out" / "final"
    assert (final / "model.safetensors").exists() and (final / "config.json").exists()
    assert (tmp_path / "out" / "checkpoint-2" / "zero_offload" / "latest").exists()


def test_use_with_lightning(tmp_path):
    pytest.importorskip("lightning")
    code = "\n".join(blocks("docs/trainers.md", "Lightning", "python"))  # the second goes on
    run([sys.executable, "-c", code], tmp_path)
    ckpt = tmp_path / "regressor.ckpt"
    assert (ckpt / "lightning.pt").exists() and (ckpt / "latest").exists()


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_relative_links_name_files_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = [
        link
        for link in links
        if "://" not in link
        and not link.startswith("#")
        and not (page.parent / link.split("#")[0]).exists()
    ]
    assert broken == [], f"{page.name} links to missing files: {broken}"
