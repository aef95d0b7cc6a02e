"""``save_on_preemption=True`` under the Lightning strategy: after the step the ranks agreed
to stop at, Lightning saves ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` (the checkpoint its
own SLURM requeue writes, which ``ckpt_path="hpc"`` resumes) from ``on_train_batch_end``,
where ``ModelCheckpoint`` saves too, and the process exits with the signal's status.

Lightning installs a SIGTERM handler of its own when fit starts (after the strategy built the
engine). It would stop the loop at its own moment, rank 0's, without a checkpoint; so at
``on_train_start`` the engine takes SIGTERM back, and Lightning's handler is put back when
the engine closes.
"""

from __future__ import annotations

import os
import re
from typing import Any

from lightning.pytorch.callbacks import Callback

from ..engine.engine import Engine
from .preemption import stop_after_save

__all__ = ["PreemptionCallback", "hpc_path"]


def hpc_path(root: str) -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in ``root``, numbered as Lightning numbers them."""
    found = [
        int(m.group(1))
        for name in (os.listdir(root) if os.path.isdir(root) else [])
        if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", name))
    ]
    return os.path.join(root, f"hpc_ckpt_{max(found, default=0) + 1}.ckpt")


class PreemptionCallback(Callback):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.engine.preemption is not None:
            self.engine.preemption.take_back()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self.engine.preempted:
            path = hpc_path(str(trainer.default_root_dir))
            trainer.save_checkpoint(path)  # the strategy uses rank 0's path on every rank
            stop_after_save(self.engine, path, hand_back=True)  # teardown calls .cpu()
