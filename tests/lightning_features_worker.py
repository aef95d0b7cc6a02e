"""Run alone (one rank): Lightning features under ZeroOffloadStrategy, each job compared
with plain Lightning (``strategy="auto"``, torch AdamW) on the library's tiny GPT-style LM.
``python lightning_features_worker.py OUT.json ROOT JOBS_JSON``; writes one result per job.

- ``order``: a ``shuffle=False`` loader yields the same batches in the same order as under
  ``strategy="auto"`` (the strategy keeps the loader's own sampler at world size 1), and the
  weights match plain Lightning.
- ``checkpoint``: ``ModelCheckpoint`` writes checkpoint folders (one per epoch; a top-k
  callback keeps only its best, removing the others through the strategy), and a new Trainer
  resumed from the first epoch's ends where the uninterrupted run did.
- ``bf16``: ``precision="bf16-mixed"`` trains the engine in bfloat16; how far it, plain
  Lightning's bf16-mixed (fp32 parameters under autocast) and fp32 end apart.
- ``recipes``: each DeepSpeed recipe file of tests/data/ds_configs trains 2 steps with
  ``ZeroOffloadStrategy(config=file)``; what the engine got is reported.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support.models import batch, loss_fn, make

from zero_offload.integrations.lightning import ZeroOffloadStrategy

LR, SAMPLES, PER_DEVICE = 1e-2, 16, 2

warnings.filterwarnings("ignore")


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = make("gpt")
        self.seen: list[list[int]] = []  # the first token of each sample, per step

    def training_step(self, data, index):
        x, y = data
        self.seen.append(x[:, 0].tolist())
        loss = loss_fn("gpt", self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)


def loader() -> torch.utils.data.DataLoader:
    x, y = batch("gpt", SAMPLES, torch.Generator().manual_seed(1234))
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=PER_DEVICE, shuffle=False
    )


def fit(
    strategy, module: L.LightningModule | None = None, ckpt_path: str | None = None, **kw
) -> tuple[L.Trainer, LitGPT]:
    args = dict(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = L.Trainer(**{**args, **kw})
    module = module or LitGPT()
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer, module


def weights(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        sd = engine.full_state_dict()
        engine.close()
        return sd
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def diff_lr(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b) / LR


def order(root: str) -> dict:
    plain_trainer, plain = fit("auto")
    ref = weights(plain_trainer, plain)
    ours_trainer, ours = fit(ZeroOffloadStrategy(stage=2))
    got = weights(ours_trainer, ours)
    return {
        "plain_seen": plain.seen,
        "seen": ours.seen,
        "max_diff_lr": diff_lr(got, ref),
        "moved_lr": diff_lr(ref, LitGPT().state_dict()),
    }


def checkpoint(root: str) -> dict:
    every = ModelCheckpoint(dirpath=f"{root}/every", filename="{epoch}", save_top_k=-1)
    best = ModelCheckpoint(dirpath=f"{root}/best", monitor="train_loss", mode="min")
    full_trainer, full = fit(
        ZeroOffloadStrategy(stage=3, offload_optimizer="cpu", offload_param="cpu"),
        max_epochs=3,
        enable_checkpointing=True,
        callbacks=[every, best],
    )
    ref = weights(full_trainer, full)
    first = f"{root}/every/epoch=0.ckpt"
    resumed_trainer, resumed = fit(
        ZeroOffloadStrategy(stage=3, offload_optimizer="cpu", offload_param="cpu"),
        max_epochs=3,
        ckpt_path=first,
    )
    return {
        "every": sorted(os.listdir(f"{root}/every")),
        "best": sorted(os.listdir(f"{root}/best")),
        "best_path": Path(best.best_model_path).name,
        "folder": sorted(os.listdir(first)),
        "global_step": resumed_trainer.global_step,
        "resume_diff_lr": diff_lr(weights(resumed_trainer, resumed), ref),
    }


def rel(a: dict, b: dict, start: dict) -> float:
    """||a - b|| over ||b - start||: how far apart two runs ended, relative to how far b moved."""
    num = sum((a[k].float() - b[k].float()).square().sum() for k in b)
    den = sum((b[k].float() - start[k].float()).square().sum() for k in b)
    return float((num / den).sqrt())


def bf16(root: str) -> dict:
    start = LitGPT().state_dict()
    plain_trainer, plain = fit("auto", precision="bf16-mixed")
    ref = weights(plain_trainer, plain)
    ours_trainer, ours = fit(ZeroOffloadStrategy(stage=2), precision="bf16-mixed")
    dtype = str(ours_trainer.strategy.engine.dtype)
    got = weights(ours_trainer, ours)
    fp32_trainer, fp32 = fit("auto")
    full = weights(fp32_trainer, fp32)
    return {
        "dtype": dtype,
        "ours_vs_fp32": rel(got, full, start),
        "plain_bf16_vs_fp32": rel(ref, full, start),
        "ours_vs_plain_bf16": rel(got, ref, start),
    }


RECIPES = Path(__file__).parent / "data" / "ds_configs"
# Lightning Trainer settings agreeing with a file's fixed values
LIGHTNING_ARGS = {  # 32 micro-batches a step; an epoch's end closes the window early
    "deepspeedexamples-pipeline_parallelism": dict(accumulate_grad_batches=32, max_epochs=2),
}


def recipes(root: str) -> dict:
    out = {}
    for path in sorted(RECIPES.glob("*.json")):
        config = json.loads(path.read_text())
        bf16 = (config.get("bf16") or config.get("bfloat16") or {}).get("enabled") is True
        kw = dict(max_steps=2, **LIGHTNING_ARGS.get(path.stem, {}))
        if bf16:
            kw["precision"] = "bf16-mixed"
        trainer, module = fit(ZeroOffloadStrategy(config=str(path)), **kw)
        engine = trainer.strategy.engine
        cfg = engine.config
        out[path.stem] = {
            "stage": cfg.stage,
            "offload_optimizer": cfg.offload.optimizer,
            "offload_param": cfg.offload.param,
            "dtype": str(cfg.dtype).removeprefix("torch."),
            "global_step": trainer.global_step,
            "finite": all(
                torch.isfinite(t).all().item() for t in weights(trainer, module).values()
            ),
        }
    return out


JOBS = {"order": order, "checkpoint": checkpoint, "bf16": bf16, "recipes": recipes}


def main() -> None:
    out, root, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    results = {job: JOBS[job](f"{root}/{job}") for job in jobs}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
