"""Run under torchrun: TRL's SFTTrainer on every rank, plain (torch AdamW, DDP over gloo) and
through zero_offload (``zero_offload_trainer(SFTTrainer)``) with each case's keywords, the same
data order; rank 0 writes how far the weights moved and how far apart the two runs ended, in
units of the learning rate: ``python trl_worker.py OUT.json ROOT CASES_JSON``."""

from __future__ import annotations

import json
import os
import sys

import torch
import trl
from support.distributed import finish_torchrun_worker
from test_trl import LR, model, train

from zero_offload.integrations.hf import zero_offload_trainer


def main() -> None:
    out, root, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    ref = train(trl.SFTTrainer, f"{root}/plain", steps=2)
    start = model().state_dict()
    results = []
    for i, config in enumerate(cases):
        got = train(
            zero_offload_trainer(trl.SFTTrainer), f"{root}/zo{i}", steps=2, zero_offload=config
        )
        results.append(
            {
                "moved_lr": max((ref[k] - start[k]).abs().max().item() for k in ref) / LR,
                "max_diff_lr": max((got[k] - ref[k]).abs().max().item() for k in ref) / LR,
            }
        )
    finish_torchrun_worker(results, out, rank)


if __name__ == "__main__":
    main()
