"""TRL's SFTTrainer through zero_offload (``zero_offload_trainer(SFTTrainer)``): a tiny Llama
and a word-level tokenizer built locally (nothing downloaded) trains to the same weights as
plain SFTTrainer with torch AdamW, within the equivalence criterion (0.03 lr in fp32):
- stage 2 with the optimizer state on the CPU;
- stage 3 with parameters and optimizer state on the CPU, and with tied embeddings on NVMe;
- stage 3 on two gloo ranks under torchrun (trl_worker.py), against plain SFTTrainer's DDP.
  SFTTrainer's fused LM head reads ``lm_head.weight`` in the model's own forward and hands it
  to a chunked autograd function that reads it again in backward, without ever calling the
  ``lm_head`` module: stage 3 gathers it on that read (and re-gathers the saved weight in
  backward)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from zero_offload.integrations.hf import zero_offload_trainer  # noqa: E402

LR = 1e-2
WORDS = [f"w{i}" for i in range(60)]


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def model(tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
            use_cache=False,
            tie_word_embeddings=tied,
        )
    )


def text() -> datasets.Dataset:
    gen = torch.Generator().manual_seed(0)
    rows = [
        " ".join(WORDS[j] for j in torch.randint(0, 60, (12,), generator=gen).tolist())
        for _ in range(16)
    ]
    return datasets.Dataset.from_dict({"text": rows})


def train(cls, out, tied: bool = False, steps: int = 4, **kw) -> dict[str, torch.Tensor]:
    args = trl.SFTConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=LR,
        weight_decay=0.0,
        max_grad_norm=0.05,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        optim="adamw_torch",
        disable_tqdm=True,
        max_length=16,
        dataloader_num_workers=0,
        bf16=False,
    )  # SFTConfig defaults to bf16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(
            model=model(tied), args=args, train_dataset=text(), processing_class=tokenizer(), **kw
        )
        trainer.train()
    if getattr(trainer, "engine", None) is not None:
        sd = trainer.engine.full_state_dict()
        trainer.engine.close()
        return sd
    return {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    runs: dict[bool, dict[str, torch.Tensor]] = {}

    def get(tied: bool) -> dict[str, torch.Tensor]:
        if tied not in runs:
            runs[tied] = train(trl.SFTTrainer, tmp_path_factory.mktemp("plain"), tied)
        return runs[tied]

    return get


CASES = {
    "stage2-cpu": (False, dict(stage=2, offload_optimizer="cpu")),
    "stage3-cpu": (False, dict(stage=3, offload_optimizer="cpu", offload_param="cpu")),
    "stage3-tied-nvme": (
        True,
        dict(stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="NVME"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sft_trainer_matches_plain_sft_trainer(plain, tmp_path, case):
    tied, config = CASES[case]
    if config.get("nvme_path") == "NVME":
        config = {**config, "nvme_path": str(tmp_path / "nvme")}
    ref = plain(tied)
    got = train(zero_offload_trainer(trl.SFTTrainer), tmp_path / "zo", tied, zero_offload=config)
    start = model(tied).state_dict()
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref) / LR
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref) / LR
    assert moved > 1.0
    assert diff <= 0.03, f"max |diff| = {diff:.4f} lr"


@pytest.mark.multiprocess
def test_sft_trainer_stage3_on_two_ranks(tmp_path):
    from support.torchrun_cases import launch

    case = dict(stage=3, offload_optimizer="cpu", offload_param="cpu")
    (r,) = launch(Path(__file__).with_name("trl_worker.py"), 2, tmp_path, [case])
    assert r["moved_lr"] > 1.0
    assert r["max_diff_lr"] <= 0.03, f"max |diff| = {r['max_diff_lr']:.4f} lr"
