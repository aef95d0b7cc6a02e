"""Run alone (one rank): Lightning features under ZeroOffloadStrategy, each job compared
with plain Lightning (``strategy="auto"``, torch AdamW) on the library's tiny GPT-style LM.
``python lightning_features_worker.py OUT.json ROOT JOBS_JSON``; writes one result per job.

- ``order``: a ``shuffle=False`` loader yields the same batches in the same order as under
  ``strategy="auto"`` (the strategy keeps the loader's own sampler at world size 1), and the
  weights match plain Lightning.
"""

from __future__ import annotations

import json
import sys
import warnings

import lightning as L
import torch

from zero_offload.integrations.lightning import ZeroOffloadStrategy

from models import batch, loss_fn, make

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


def fit(strategy, module: L.LightningModule | None = None, **kw) -> tuple[L.Trainer, LitGPT]:
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
    trainer.fit(module, loader())
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


JOBS = {"order": order}


def main() -> None:
    out, root, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    results = {job: JOBS[job](f"{root}/{job}") for job in jobs}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
