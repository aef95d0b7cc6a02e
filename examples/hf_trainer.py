"""Fine-tune a Llama with Hugging Face Trainer on zero_offload: ZeRO stage 3, the parameters
and the optimizer state on NVMe, step stats logged to TensorBoard.

    python examples/hf_trainer.py                       # a tiny Llama, a few seconds on a CPU
    torchrun --nproc_per_node 2 examples/hf_trainer.py  # the same on two ranks
    tensorboard --logdir runs/hf_trainer                # loss, lr, grad_norm, zero_offload/*

The only change from a plain Trainer script is ``ZeroOffloadTrainer(..., zero_offload=...)``.
To fine-tune a real checkpoint, build the model with ``from_pretrained`` (or on the meta
device with ``init_weights=`` in ``zero_offload``) and point ``--nvme-path`` at a fast disk.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from zero_offload.integrations.hf import ZeroOffloadTrainer


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            use_cache=False,
        )
    )


def counting_data(samples: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """Sequences that count up from a random start: easy to learn, so the loss falls fast."""
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 256, (samples, 1), generator=gen)
    ids = (starts + torch.arange(seq)) % 256
    return [{"input_ids": x, "labels": x} for x in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument(
        "--nvme-path",
        default=None,
        help="folder on a fast disk for the swap files (default: a temporary one)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf_trainer_nvme_") as tmp:
        training = TrainingArguments(
            output_dir=args.output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=3e-3,
            warmup_steps=3,
            lr_scheduler_type="cosine",
            max_grad_norm=1.0,
            logging_steps=5,
            save_strategy="no",
            report_to=["tensorboard"],
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        )
        trainer = ZeroOffloadTrainer(
            model=tiny_llama(),
            args=training,
            train_dataset=counting_data(512, 32),
            zero_offload=dict(
                stage=3,
                offload_param="nvme",
                offload_optimizer="nvme",
                nvme_path=args.nvme_path or tmp,
            ),
        )
        result = trainer.train()
        trainer.save_model()
        trainer.engine.close()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(
            f"{result.global_step} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
            f"model and TensorBoard logs in {args.output_dir}"
        )


if __name__ == "__main__":
    main()
