"""Run under torchrun (or alone): Lightning cases, each trained with the same data order by
plain Lightning (torch AdamW; ``strategy="auto"`` on one rank, DDP across ranks), by the
zero_offload strategy (4 steps over two epochs), and by the strategy again in two halves: one
epoch, ``trainer.save_checkpoint``, then a new Trainer resumed with ``fit(ckpt_path=...)``.
Rank 0 writes what it measured as JSON: ``python lightning_worker.py OUT.json ROOT
CASES_JSON``; a case is a strategy name or a dict of ZeroOffloadStrategy keywords, where
``"configure_model": true`` builds the model in ``configure_model`` (the strategy's
sharded-construction context) and starts the engine from the plain run's initial weights
(``init_weights``); ``"buffers": true`` instead trains a BatchNorm model whose ranks see
different batches and reports how far each rank's running statistics were from rank 0's as
each training forward began (the engine's ``broadcast_buffers``, as DDP)."""

from __future__ import annotations

import csv
import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from support.distributed import finish_torchrun_worker
from support.models import batch, loss_fn, make

import zero_offload.integrations.lightning  # noqa: F401  (registers the strategy names)
from zero_offload.integrations.lightning import ZeroOffloadStrategy

LR, WD, CLIP, SAMPLES, PER_DEVICE, ACCUMULATE = 1e-2, 0.1, 0.05, 16, 2, 2

warnings.filterwarnings("ignore")


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = make("gpt")

    def training_step(self, data, index):
        x, y = data
        loss = loss_fn("gpt", self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        named = list(self.named_parameters())  # biases and norms without weight decay
        opt = torch.optim.AdamW(
            [
                {"params": [p for _, p in named if p.ndim > 1]},
                {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0},
            ],
            lr=LR,
            weight_decay=WD,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return [opt], [{"scheduler": sched, "interval": "step"}]


class LateLitGPT(LitGPT):
    """The same model, built in ``configure_model`` (under the strategy's context)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.net: torch.nn.Module | None = None
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = make("gpt")
            self.built_on_meta = all(p.is_meta for p in self.net.parameters())


def loader() -> torch.utils.data.DataLoader:
    x, y = batch("gpt", SAMPLES, torch.Generator().manual_seed(1234))
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=PER_DEVICE, shuffle=False
    )


def fit(
    strategy,
    epochs: int,
    logdir: str | None = None,
    ckpt: str | None = None,
    module_class: type = LitGPT,
):
    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        logger=CSVLogger(logdir) if logdir else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = module_class()
    trainer.fit(module, loader(), ckpt_path=ckpt)
    return trainer, module


def weights(trainer, module) -> dict[str, torch.Tensor]:
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        sd = engine.full_state_dict()
        engine.close()
        return sd
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class LitNorm(L.LightningModule):
    """A BatchNorm model: its running statistics are buffers that each rank's data moves."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.seen: list[torch.Tensor] = []  # running_mean as each training forward began

    def forward(self, x):
        if self.training:
            self.seen.append(self.bn.running_mean.detach().clone())
        return self.bn(self.lin(x))

    def training_step(self, data, index):
        (x,) = data
        return self(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def buffers_case(case: dict) -> dict:
    import torch.distributed as dist

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(7)) * 3 + 1
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=PER_DEVICE)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=ZeroOffloadStrategy(**{k: v for k, v in case.items() if k != "buffers"}),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = LitNorm()
    trainer.fit(module, data)
    seen = torch.stack(module.seen)
    gathered = [torch.empty_like(seen) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, seen)
    trainer.strategy.engine.close()
    return {
        "forwards": len(module.seen),
        "spread": max((g - gathered[0]).abs().max().item() for g in gathered),
        "moved": (seen[-1] - seen[0]).abs().max().item(),
    }


def strategy_for(case):
    if isinstance(case, str):
        return case
    return ZeroOffloadStrategy(**case)


def run_case(root: str, index: int, case, rank: int) -> dict:
    if isinstance(case, dict) and case.get("buffers"):
        return buffers_case(case)
    tag = f"{root}/case{index}"
    res: dict = {}
    # the same data order as ours: the loader's own on one process (the strategy keeps it,
    # as strategy="auto" does), Lightning's DistributedSampler on more
    world = int(os.environ.get("WORLD_SIZE", 1))
    plain = weights(*fit("auto" if world == 1 else "ddp", 2))
    start = LitGPT().state_dict()
    module_class: type = LitGPT
    if isinstance(case, dict) and case.get("configure_model"):
        from safetensors.torch import save_file

        os.makedirs(tag, exist_ok=True)
        path = f"{tag}/start{rank}.safetensors"
        save_file({k: v for k, v in start.items() if k != "net.lm_head.weight"}, path)  # tied
        case = {k: v for k, v in case.items() if k != "configure_model"}
        case["init_weights"] = path
        module_class = LateLitGPT
    trainer, module = fit(strategy_for(case), 2, logdir=f"{tag}/logs", module_class=module_class)
    res["built_on_meta"] = getattr(module, "built_on_meta", None)
    full = weights(trainer, module)
    res["global_step"] = trainer.global_step
    half, _ = fit(strategy_for(case), 1, module_class=module_class)
    half.save_checkpoint(f"{tag}/half.ckpt")
    half.strategy.engine.close()
    resumed = weights(
        *fit(strategy_for(case), 2, ckpt=f"{tag}/half.ckpt", module_class=module_class)
    )
    if rank == 0:
        res["moved_lr"] = max((plain[k] - start[k]).abs().max().item() for k in plain) / LR
        res["max_diff_lr"] = max((full[k] - plain[k]).abs().max().item() for k in plain) / LR
        res["resume_diff_lr"] = max((resumed[k] - full[k]).abs().max().item() for k in full) / LR
        res["checkpoint_files"] = sorted(os.listdir(f"{tag}/half.ckpt"))
        metrics = next(Path(f"{tag}/logs").rglob("metrics.csv"))
        with open(metrics) as f:
            res["logged"] = sorted(next(csv.reader(f)))
    return res


def main() -> None:
    out, root, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    results = [run_case(root, i, case, rank) for i, case in enumerate(cases)]
    finish_torchrun_worker(results, out, rank)


if __name__ == "__main__":
    main()
