"""Regenerate reference.json with real DeepSpeed (run it where DeepSpeed is installed):

    python tests/data/deepspeed_reference/make_reference.py

What DeepSpeed itself computes for the behaviours zero_offload reproduces from its configs:
- the learning rate each of the first steps runs at under its lr schedules (the scheduler
  built from a config section, stepped after every step as DeepSpeed's engine steps it);
- its dynamic loss scale after each step of an overflow pattern, with hysteresis;
- its gradient_clipping default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.config import get_gradient_clipping
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

STEPS = 12
LR = 0.1
SCHEDULES = [
    {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5},
    },
    {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
    {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": 10, "warmup_max_lr": 0.05, "warmup_num_steps": 3},
    },
    {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": 9,
            "warmup_num_steps": 3,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01,
            "warmup_type": "linear",
        },
    },
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 2}},
]
KINDS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
# overflow (1) or not (0) at each step, and the scaler settings
OVERFLOWS = [0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0]
SCALERS = [
    dict(
        init_scale=2.0**10,
        scale_window=1000,
        min_scale=1,
        delayed_shift=2,
        consecutive_hysteresis=False,
    ),
    dict(
        init_scale=2.0**10,
        scale_window=1000,
        min_scale=1,
        delayed_shift=3,
        consecutive_hysteresis=True,
    ),
    dict(
        init_scale=2.0**10,
        scale_window=4,
        min_scale=1,
        delayed_shift=1,
        consecutive_hysteresis=False,
    ),
]


def lrs(section: dict) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = KINDS[section["type"]](opt, **section["params"])
    out = []
    for _ in range(STEPS):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


def scales(settings: dict) -> list[float]:
    scaler = DynamicLossScaler(**settings, raise_error_at_min_scale=False)
    out = []
    for overflow in OVERFLOWS:
        scaler.update_scale(bool(overflow))
        out.append(scaler.cur_scale)
    return out


def main() -> None:
    dist.init_distributed(dist_backend="gloo", world_size=1, rank=0, auto_mpi_discovery=False)
    ref = {
        "deepspeed": deepspeed.__version__,
        "lr": LR,
        "schedules": [{"section": s, "lrs": lrs(s)} for s in SCHEDULES],
        "overflows": OVERFLOWS,
        "scalers": [{"settings": s, "scales": scales(s)} for s in SCALERS],
        "gradient_clipping_default": get_gradient_clipping({}),
    }
    out = Path(__file__).with_name("reference.json")
    out.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
