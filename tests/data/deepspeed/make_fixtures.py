"""Regenerate the DeepSpeed checkpoint fixtures in this folder with real DeepSpeed.

Run from the repository root with a Python that has DeepSpeed 0.19.8 (CPU accelerator) and the
repository on its path, e.g.

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD:$PWD/tests python tests/data/deepspeed/make_fixtures.py

For each ZeRO stage (1, 2, 3) and world size (1, 2), and stage 3 on 2 ranks with the optimizer
offloaded to the CPU (``s3w2-cpu``: ZeRO-Offload's DeepSpeedCPUAdam), it trains the tests' tiny GPT
(``support.models.TinyGPT(width=16)``: tied embeddings, ``wpe.weight`` frozen, AdamW with a no-decay
group for biases and norms, gradients clipped at ``CLIP`` on both sides) for ``SAVE_AT`` steps,
saves a DeepSpeed checkpoint, trains ``CONTINUE`` more steps and records where DeepSpeed got to:

    s<stage>w<world>/latest, s<stage>w<world>/global_step<SAVE_AT>/...   the checkpoint as saved
    s<stage>w<world>/masters.safetensors    fp32 masters at the save (DeepSpeed's zero_to_fp32)
    s<stage>w<world>/expected.safetensors   fp32 masters after CONTINUE more DeepSpeed steps
    s<stage>w<world>/run.json               the DeepSpeed config, versions, step sizes, losses

Variants: ``-bf16`` trains in bf16 (``bf16.enabled``: DeepSpeed 0.19.8 names the optimizer files
``bf16_zero_pp_rank_*`` at every stage); ``-adaml2`` lets DeepSpeed build the optimizer from the
config (``Adam`` with ``adam_w_mode: false`` and ``torch_adam``: torch.optim.Adam, L2 decay, one
param group), so the checkpoint's ``ds_config`` and param groups say Adam, not AdamW.

The ``hf`` case runs ``transformers.Trainer`` with ``TrainingArguments(deepspeed=...)``
(ZeRO 2, 1 rank), saving ``hf/checkpoint-<SAVE_AT>`` and recording where that run ends;
``hf-dsched`` is the same with the config's own ``scheduler`` (WarmupDecayLR, run by DeepSpeed).

The tests read only these files (CI has no DeepSpeed). Each rank of a world-2 case is a process
of its own, joined by gloo; the data of every step is
``support.models.batch("gpt", GLOBAL_BATCH, ...)`` split across the ranks, so any world size
sees the same global batch.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAVE_AT, CONTINUE, GLOBAL_BATCH = 3, 3, 8
LR, WD, CLIP, WIDTH = 1e-2, 0.1, 0.5, 16
FROZEN = "wpe.weight"


def batch_for(step: int):
    import torch
    from support.models import batch

    return batch("gpt", GLOBAL_BATCH, torch.Generator().manual_seed(100 + step))


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": WD},
        {"params": no_decay, "weight_decay": 0.0},
    ]


ADAM_L2 = {  # DeepSpeed builds torch.optim.Adam (L2 decay) from this section
    "type": "Adam",
    "params": {"lr": LR, "weight_decay": WD, "torch_adam": True, "adam_w_mode": False},
}


def ds_config(stage: int, world: int, variant: str) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if variant == "cpu":  # ZeRO-Offload: DeepSpeedCPUAdam on the host
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    extra: dict = {}
    if variant == "bf16":
        extra["bf16"] = {"enabled": True}
    if variant == "adaml2":
        extra["optimizer"] = ADAM_L2
    return {
        **extra,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "train_batch_size": GLOBAL_BATCH,
        "gradient_clipping": CLIP,  # DeepSpeed 0.19 clips at 1.0 unless told otherwise
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }


def masters(save_dir: Path, tag: str) -> dict:
    """DeepSpeed's own reading of its checkpoint: fp32 masters by name (tied names once)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag)
    seen, out = set(), {}
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor.contiguous().clone()
    return out


def train_rank(rank: int, world: int, stage: int, variant: str, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from support.models import TinyGPT

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyGPT(width=WIDTH)
    model.get_parameter(FROZEN).requires_grad_(False)
    optimizer = None  # -adaml2: DeepSpeed builds it from the config
    if variant == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(param_groups(model), lr=LR, weight_decay=WD, adamw_mode=True)
    elif variant != "adaml2":
        optimizer = torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=WD)
    config = ds_config(stage, world, variant)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, built, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=params, config=config
    )
    per = GLOBAL_BATCH // world
    losses, norms = [], []

    def step(i: int) -> None:
        x, y = batch_for(i)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        logits = engine(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))

    for i in range(SAVE_AT):
        step(i)
    save_dir = Path(out)
    engine.save_checkpoint(str(save_dir))
    for i in range(SAVE_AT, SAVE_AT + CONTINUE):
        step(i)
    scratch = save_dir.parent / f".{save_dir.name}.end"  # the end state, as DeepSpeed reads it
    engine.save_checkpoint(str(scratch), tag="end")
    dist.barrier()
    if rank == 0:
        save_file(masters(scratch, "end"), str(save_dir / "expected.safetensors"))
        shutil.rmtree(scratch)
    if rank == 0:
        tag = f"global_step{SAVE_AT}"
        save_file(masters(save_dir, tag), str(save_dir / "masters.safetensors"))
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies, not data
            (save_dir / script).unlink(missing_ok=True)
        run = dict(
            deepspeed=deepspeed.__version__,
            torch=torch.__version__,
            stage=stage,
            world_size=world,
            optimizer=type(getattr(built, "optimizer", built)).__name__,
            variant=variant,
            config=config,
            lr=LR,
            weight_decay=WD,
            clip=CLIP,
            width=WIDTH,
            frozen=[FROZEN],
            save_at=SAVE_AT,
            steps=SAVE_AT + CONTINUE,
            global_batch=GLOBAL_BATCH,
            losses=losses,
            grad_norms=norms,
        )
        (save_dir / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_case(name: str) -> None:
    """``s<stage>w<world>``, or with ``-cpu`` the optimizer offloaded (DeepSpeedCPUAdam),
    ``-bf16`` bf16 training, ``-adaml2`` DeepSpeed's config-built Adam with L2 decay."""
    import torch.multiprocessing as mp

    stage, world, variant = int(name[1]), int(name[3]), name.partition("-")[2]
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    mp.start_processes(
        train_rank,
        args=(world, stage, variant, free_port(), str(out)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    print(f"wrote {out}", flush=True)


def main(argv: list[str]) -> int:
    cases = argv or [f"s{s}w{w}" for s in (1, 2, 3) for w in (1, 2)] + [
        "s3w2-cpu",
        *[f"s{s}w2-bf16" for s in (1, 2, 3)],
        "s3w1-adaml2",
        "hf",
        "hf-dsched",
    ]
    for case in cases:
        if case.startswith("hf"):
            from hf_fixture import CONFIG, CONFIG_DS_SCHEDULE, hf_case

            hf_case(HERE / case, CONFIG_DS_SCHEDULE if case == "hf-dsched" else CONFIG)
        else:
            ds_case(case)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main(sys.argv[1:]))
