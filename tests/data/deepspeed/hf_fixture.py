"""The Hugging Face Trainer fixture: a tiny GPT-2 trained by ``transformers.Trainer`` with
DeepSpeed ZeRO 2 (``TrainingArguments(deepspeed=CONFIG)``), checkpoint saved at ``SAVE_AT``.

``make_model``, ``dataset`` and ``arguments`` are shared by the fixture script (run with
DeepSpeed) and the test that resumes the checkpoint under ``ZeroOffloadTrainer`` (no
DeepSpeed needed), so both sides train the same model on the same data order.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

SAVE_AT, STEPS, SAMPLES, SEQ, VOCAB = 3, 6, 32, 16, 64
LR, WD, CLIP, PER_DEVICE, GAS = 1e-2, 0.1, 0.5, 2, 2

# what a recipe file looks like: the Trainer fills the "auto" values from TrainingArguments
CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
    "steps_per_print": 10**9,
}
# the same with DeepSpeed's own lr schedule (the config's "scheduler", stepped by DeepSpeed)
CONFIG_DS_SCHEDULE: dict[str, Any] = {
    **CONFIG,
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
}


def make_model() -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_layer=2,
        n_embd=16,
        n_head=2,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(cfg)


def dataset() -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
    return [{"input_ids": x, "labels": x} for x in ids]


def arguments(out: str | os.PathLike, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base: dict[str, Any] = dict(
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=GAS,
        max_steps=STEPS,
        learning_rate=LR,
        weight_decay=WD,
        max_grad_norm=CLIP,
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to=[],
        use_cpu=True,
        seed=0,
        optim="adamw_torch",
        disable_tqdm=True,
    )
    base.update(kw)
    return TrainingArguments(output_dir=str(out), **base)


def hf_case(out: Path, config: dict[str, Any]) -> None:
    """Train with DeepSpeed, keep ``checkpoint-SAVE_AT``, record where the run ended."""
    import socket

    import torch
    from safetensors.torch import save_file
    from transformers import Trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed
    from make_fixtures import masters

    shutil.rmtree(out, ignore_errors=True)
    work = out.parent / f".{out.name}.run"
    shutil.rmtree(work, ignore_errors=True)
    torch.set_num_threads(1)
    trainer = Trainer(
        model=make_model(),
        args=arguments(work, deepspeed=config),
        train_dataset=dataset(),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    end = work / "end"
    trainer.model_wrapped.save_checkpoint(str(end), tag="end")
    out.mkdir(parents=True)
    save_file(masters(end, "end"), str(out / "expected.safetensors"))
    checkpoint = out / f"checkpoint-{SAVE_AT}"
    shutil.copytree(work / f"checkpoint-{SAVE_AT}", checkpoint)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies, not data
        (checkpoint / script).unlink(missing_ok=True)
    shutil.rmtree(work)
    run = dict(
        deepspeed=deepspeed.__version__,
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        config=config,
        save_at=SAVE_AT,
        steps=STEPS,
        losses=losses,
        grad_norms=norms,
        learning_rates=lrs,
    )
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
