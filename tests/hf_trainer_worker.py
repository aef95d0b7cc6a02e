"""Run under torchrun (or alone): Hugging Face Trainer cases, each trained three ways with the
same data order: plain Trainer with torch AdamW (DDP across ranks; for a DeepSpeed config, doing
what Hugging Face's DeepSpeed integration does with it), ZeroOffloadTrainer, and
ZeroOffloadTrainer resumed from the checkpoint the second run saved halfway. Rank 0 writes
what it measured as JSON: ``python hf_trainer_worker.py OUT.json ROOT CASES_JSON``.

Each case: (model name, zero_offload config: keywords or a DeepSpeed dict)."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import transformers
from support.distributed import finish_torchrun_worker
from transformers import Trainer, TrainingArguments

from zero_offload.integrations.hf import ZeroOffloadTrainer, deepspeed_schedule

LR, CLIP, VOCAB, SEQ, SAMPLES, STEPS = 1e-2, 0.05, 128, 16, 32, 4
PER_DEVICE, GAS = 2, 2

warnings.filterwarnings("ignore", category=FutureWarning)


def make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, use_cache=False)
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="eager",
            **common,
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        attn_implementation="sdpa",
        **common,
    )
    return transformers.LlamaForCausalLM(cfg)


def dataset() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
    return [{"input_ids": x, "labels": x} for x in ids]


def arguments(out: str, **kw) -> TrainingArguments:
    kw = dict(
        dict(
            per_device_train_batch_size=PER_DEVICE,
            gradient_accumulation_steps=GAS,
            max_steps=STEPS,
            learning_rate=LR,
            weight_decay=0.1,
            max_grad_norm=CLIP,
            lr_scheduler_type="linear",
            warmup_steps=1,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            optim="adamw_torch",
            disable_tqdm=True,
            dataloader_num_workers=0,
        ),
        **kw,
    )
    return TrainingArguments(output_dir=out, **kw)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def diff_lr(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b) / LR


def deepspeed_like(config: dict) -> type:
    """Plain Trainer doing what Hugging Face's DeepSpeed integration does with ``config``: an
    ``optimizer`` section decays every parameter (DeepSpeed's optimizer has no no-decay
    group), a ``scheduler`` section's schedule replaces ``lr_scheduler_type`` (DeepSpeed's
    formulas, checked against DeepSpeed itself in test_ds_schedules.py)."""

    class DeepSpeedLike(Trainer):
        def get_decay_parameter_names(self, model):
            if "optimizer" not in config:
                return super().get_decay_parameter_names(model)
            return [n for n, _ in model.named_parameters()]

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None and "scheduler" in config:
                self.lr_scheduler = deepspeed_schedule(
                    self.args, config, optimizer or self.optimizer, num_training_steps
                )
            return super().create_scheduler(num_training_steps, optimizer)

    return DeepSpeedLike


def run_case(root: str, index: int, name: str, config, rank: int) -> dict:
    res: dict = {}
    tag = f"{root}/case{index}-{name}"  # the same on every rank
    if isinstance(config, dict) and "nvme_path" in json.dumps(config):
        config = json.loads(json.dumps(config).replace("NVME", f"{tag}/nvme"))

    reference = deepspeed_like(config) if "zero_optimization" in config else Trainer
    plain = reference(model=make(name), args=arguments(f"{tag}/plain"), train_dataset=dataset())
    plain.train()
    res["plain_eval_loss"] = plain.evaluate(dataset()[:8])["eval_loss"]
    ref = params(plain.model)
    start = params(make(name))
    res["moved_lr"] = diff_lr(ref, start)

    zo = ZeroOffloadTrainer(
        model=make(name),
        args=arguments(f"{tag}/zo", save_strategy="steps", save_steps=STEPS // 2),
        train_dataset=dataset(),
        zero_offload=config,
    )
    zo.train()
    res["eval_loss"] = zo.evaluate(dataset()[:8])["eval_loss"]  # forward through the engine
    full = zo.engine.full_state_dict()
    zo.save_model(f"{tag}/final")
    logged = [h for h in zo.state.log_history if "loss" in h]
    res["logged_keys"] = sorted(logged[-1]) if logged else []
    res["lrs"] = [h["learning_rate"] for h in logged]
    res["plain_lrs"] = [h["learning_rate"] for h in plain.state.log_history if "loss" in h]
    res["losses"] = [h["loss"] for h in logged]
    res["plain_losses"] = [h["loss"] for h in plain.state.log_history if "loss" in h]
    zo.engine.close()

    resumed = ZeroOffloadTrainer(
        model=make(name),
        args=arguments(f"{tag}/resumed"),
        train_dataset=dataset(),
        zero_offload=config,
    )
    resumed.train(resume_from_checkpoint=f"{tag}/zo/checkpoint-{STEPS // 2}")
    again = resumed.engine.full_state_dict()
    resumed.engine.close()
    if rank == 0:
        res["max_diff_lr"] = diff_lr(full, ref)
        res["resume_diff_lr"] = diff_lr(again, full)
        loaded = type(plain.model).from_pretrained(f"{tag}/final")
        res["saved_diff_lr"] = diff_lr(params(loaded), full)
        res["saved_files"] = sorted(os.listdir(f"{tag}/final"))
        res["checkpoint_files"] = sorted(os.listdir(f"{tag}/zo/checkpoint-{STEPS // 2}"))
    return res


def main() -> None:
    out, root, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    results = []
    for i, (name, config) in enumerate(cases):
        results.append(run_case(root, i, name, config, int(os.environ.get("RANK", 0))))
    finish_torchrun_worker(results, out, int(os.environ.get("RANK", 0)))


if __name__ == "__main__":
    main()
