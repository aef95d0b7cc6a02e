"""ZeroOffloadTrainer features beyond the equivalence runs (test_hf_trainer.py), each in one
process with a tiny Llama:
- Trainer's no-decay group (biases, norm weights: ``get_decay_parameter_names``) reaches the
  engine: with weight decay on, the trained weights match plain Trainer with torch AdamW;
- a step skipped on an fp16 overflow does not advance Trainer's lr scheduler (as with
  DeepSpeed): the scheduler counts applied steps only;
- ``load_best_model_at_end`` restores the best checkpoint's engine state at stage 3.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_trainer_worker import LR, arguments, dataset, diff_lr, make, params  # noqa: E402

from zero_offload.integrations.hf import ZeroOffloadTrainer  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)


def test_no_decay_group_matches_plain_trainer(tmp_path):
    args = dict(weight_decay=0.5, max_steps=3)
    plain = transformers.Trainer(
        model=make("gpt2"), args=arguments(str(tmp_path / "p"), **args), train_dataset=dataset()
    )
    decayed = set(plain.get_decay_parameter_names(plain.model))
    assert any(
        "bias" in n or "ln" in n for n, _ in plain.model.named_parameters() if n not in decayed
    ), "the model must have a no-decay group"
    plain.train()
    ref = params(plain.model)
    zo = ZeroOffloadTrainer(
        model=make("gpt2"),
        args=arguments(str(tmp_path / "z"), **args),
        train_dataset=dataset(),
        zero_offload=dict(stage=2, offload_optimizer="cpu"),
    )
    zo.train()
    got = zo.engine.full_state_dict()
    zo.engine.close()
    assert diff_lr(got, ref) <= 0.03, f"max |diff| = {diff_lr(got, ref):.4f} lr"


def test_fp16_overflow_does_not_advance_the_lr_scheduler(tmp_path):
    steps = 8
    zo = ZeroOffloadTrainer(
        model=make("llama"),
        args=arguments(str(tmp_path), fp16=True, max_steps=steps),
        train_dataset=dataset(),
        zero_offload=dict(stage=2, offload_optimizer="cpu", initial_loss_scale=2.0**20),
    )
    zo.train()
    skipped, applied_steps = zo.engine.skipped_steps, zo.engine.optimizer_steps
    zo.engine.close()
    logged = [h for h in zo.state.log_history if "loss" in h]
    assert skipped >= 1 and applied_steps >= 2
    assert skipped + applied_steps == steps == len(logged)
    assert zo.lr_scheduler.last_epoch == applied_steps
    # each step ran at the lr of the updates applied before it (linear schedule, warmup 1)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, steps)
    schedule = []
    for _ in range(steps):
        schedule.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    applied = [int(h["zero_offload/applied"]) for h in logged]
    expected = [schedule[sum(applied[:i])] for i in range(steps)]
    assert [h["learning_rate"] for h in logged] == pytest.approx(expected)


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    # greater_is_better on the eval loss: the best checkpoint is not the last one
    args = arguments(
        str(tmp_path),
        max_steps=3,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
    )
    zo = ZeroOffloadTrainer(
        model=make("llama"),
        args=args,
        train_dataset=dataset(),
        eval_dataset=dataset()[:8],
        zero_offload=dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
    )
    zo.train()
    evals = [h["eval_loss"] for h in zo.state.log_history if "eval_loss" in h]
    best = zo.state.best_model_checkpoint
    top = evals.index(max(evals))
    assert top < len(evals) - 1 and best.endswith(f"checkpoint-{top + 1}")
    got = zo.engine.full_state_dict()
    after = zo.evaluate()["eval_loss"]
    zo.engine.close()
    saved = params(type(zo.model).from_pretrained(best))
    assert diff_lr(got, saved) == 0.0
    assert after == pytest.approx(evals[top], rel=1e-6)


def test_consolidate_takes_a_trainer_checkpoint_folder(tmp_path, capsys):
    """``zero-offload consolidate out/checkpoint-2 OUT``: the engine checkpoint inside a
    Trainer checkpoint folder (and the newest one under ``output_dir``) is found."""
    from safetensors.torch import load_file

    from zero_offload.cli import main

    args = arguments(str(tmp_path / "out"), max_steps=2, save_strategy="steps", save_steps=1)
    zo = ZeroOffloadTrainer(
        model=make("llama"),
        args=args,
        train_dataset=dataset(),
        zero_offload=dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
    )
    zo.train()
    want = zo.engine.full_state_dict()
    zo.engine.close()
    for folder in ("out/checkpoint-2", "out"):
        out = tmp_path / f"{folder.replace('/', '-')}.safetensors"
        assert main(["consolidate", str(tmp_path / folder), str(out)]) == 0, capsys.readouterr()
        assert "checkpoint-2/zero_offload:" in capsys.readouterr().out  # the one it took
        got = load_file(str(out))
        assert got and all(torch.equal(got[k], want[k]) for k in got)
    assert main(["consolidate", str(tmp_path), str(tmp_path / "x.safetensors")]) == 1
    assert "checkpoint-N" in capsys.readouterr().err
