"""``save_on_preemption=True`` under ZeroOffloadTrainer: SIGTERM during training makes Trainer
save ``checkpoint-<step>`` after the step in flight, the process exits with status 143, and
``resume_from_checkpoint=True`` in a new process ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import signal
import textwrap

import pytest
import torch
from support.children import next_line, start_python

T = 900  # seconds per child: Trainer and Lightning imports on a loaded machine

TRAIN = """
import json, sys, time, torch
sys.path.insert(0, "tests")
from transformers import TrainerCallback
from hf_trainer_worker import arguments, dataset, make
from zero_offload.integrations.hf import ZeroOffloadTrainer

nvme = sys.argv[1]

class Lines(TrainerCallback):
    def on_step_end(self, args, st, control, **kw):
        print("step", st.global_step, flush=True)
        time.sleep(0.3)  # room for the signal to land inside the next step

for out, steps, resume, state in json.loads(sys.argv[2]):  # the runs, one after another
    trainer = ZeroOffloadTrainer(
        model=make("gpt2"),
        args=arguments(out, max_steps=steps, lr_scheduler_type="constant", warmup_steps=0),
        train_dataset=dataset(),
        zero_offload=dict(
            stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=nvme,
            sub_group_size=4096, save_on_preemption=True,
        ),
        callbacks=[Lines()],
    )
    trainer.train(resume_from_checkpoint=True if resume == "resume" else None)
    torch.save(trainer.engine.full_state_dict(), state)
    print("ended", trainer.state.global_step, flush=True)
    trainer.engine.close()
"""


def _runs(tmp, *runs: tuple[str, int, str, str]) -> str:
    """(output folder, steps, "resume" or not, state file) per run, as the children take them."""
    return json.dumps(
        [(str(tmp / out), steps, resume, str(tmp / state)) for out, steps, resume, state in runs]
    )


def _start(tmp, *runs: tuple[str, int, str, str]):
    """A child making ``runs`` one after another (the resumed run, then the uninterrupted one,
    share a process: transformers is imported once)."""
    (tmp / "nvme").mkdir(exist_ok=True)
    return start_python(textwrap.dedent(TRAIN), str(tmp / "nvme"), _runs(tmp, *runs))


def _ended(child) -> list[str]:
    out, err = child.communicate(timeout=T)
    assert child.returncode == 0, err[-3000:]
    return [line for line in out.splitlines() if line.startswith("ended")]


@pytest.mark.multiprocess
def test_sigterm_under_zero_offload_trainer_saves_a_trainer_checkpoint(tmp_path):
    first = _start(tmp_path, ("run", 1000, "no", "first.pt"))
    assert next_line(first, T) == "step 1"
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=T)
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = sorted((tmp_path / "run").glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "zero_offload" / "latest").is_file(), saved
    at = int(saved[0].name.split("-")[1])
    both = _start(
        tmp_path, ("run", at + 2, "resume", "resumed.pt"), ("straight", at + 2, "no", "straight.pt")
    )
    assert _ended(both) == [f"ended {at + 2}"] * 2
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert list((tmp_path / "nvme").iterdir()) == []


FIT = """
import json, sys, time, torch, lightning as L
sys.path.insert(0, "tests")
from lightning_worker import LitGPT
from support.models import batch
from zero_offload.integrations.lightning import ZeroOffloadStrategy

nvme = sys.argv[1]

class Lines(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        print("step", trainer.global_step, flush=True)
        time.sleep(0.3)  # room for the signal to land inside the next step

# one batch an epoch: each step ends an epoch, where Lightning resumes the data order exactly
# (mid-epoch it restarts a plain loader's epoch)
x, y = batch("gpt", 8, torch.Generator().manual_seed(1234))
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
for root, steps, resume, state in json.loads(sys.argv[2]):  # the runs, one after another
    strategy = ZeroOffloadStrategy(
        stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=nvme,
        sub_group_size=4096, save_on_preemption=True,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=int(steps), max_epochs=-1,
        default_root_dir=root, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Lines()],
    )
    trainer.fit(LitGPT(), data, ckpt_path="hpc" if resume == "resume" else None)
    torch.save(strategy.engine.full_state_dict(), state)
    print("ended", trainer.global_step, flush=True)
    strategy.engine.close()
"""


def _fit(tmp, *runs: tuple[str, int, str, str]):
    """As _start, under Lightning."""
    (tmp / "nvme").mkdir(exist_ok=True)
    return start_python(textwrap.dedent(FIT), str(tmp / "nvme"), _runs(tmp, *runs))


@pytest.mark.multiprocess
def test_sigterm_under_the_lightning_strategy_saves_an_hpc_checkpoint(tmp_path):
    first = _fit(tmp_path, ("run", 1000, "no", "first.pt"))
    assert next_line(first, T) == "step 1"
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=T)
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = sorted((tmp_path / "run").glob("hpc_ckpt_*.ckpt"))
    assert [p.name for p in saved] == ["hpc_ckpt_1.ckpt"], err[-3000:]
    both = _fit(tmp_path, ("run", 6, "resume", "resumed.pt"), ("straight", 6, "no", "straight.pt"))
    assert _ended(both) == ["ended 6"] * 2
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert list((tmp_path / "nvme").iterdir()) == []
