"""``ZeroOffloadTrainer`` with ``tiled_loss``: what its ``compute_loss`` calls in place of the
model, so that Trainer's own ``compute_loss`` still does what it does around the call
(``num_items_in_batch``, the scaling for ``average_tokens_across_devices``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..activations.tiled_loss import tiled_causal_lm_loss

__all__ = ["TiledLoss", "tiled_loss_model"]

log = logging.getLogger(__name__)


class TiledLoss:
    """The model's inputs in, ``{"loss": the tiled loss}`` out, run as a forward of the
    engine with the head gathered once for all tiles."""

    def __init__(self, engine: Any, tile_tokens: int) -> None:
        self.engine, self.tile_tokens = engine, tile_tokens

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        loss = self.engine.run(
            tiled_causal_lm_loss,
            self.engine.module,
            tile_tokens=self.tile_tokens,
            gather=self.engine.gathered,
            **inputs,
        )
        return {"loss": loss}


def tiled_loss_model(trainer: Any, model: Any, inputs: dict, return_outputs: bool) -> Any:
    """What ``trainer.compute_loss`` should call: :class:`TiledLoss` for a training step
    with labels under ``tiled_loss``, else ``model``. Where the outputs are needed too
    (``return_outputs``, a label smoother, ``compute_loss_func``: e.g. TRL's SFTTrainer,
    which reads the logits) the plain loss runs, with one warning."""
    tiles = trainer.engine.config.activations.tiled_loss
    if not (tiles and model.training and "labels" in inputs):
        return model
    if return_outputs or trainer.label_smoother is not None or trainer.compute_loss_func:
        if not getattr(trainer, "_warned_untiled", False):
            trainer._warned_untiled = True
            log.warning(
                "tiled_loss: this Trainer's compute_loss needs the model's outputs "
                "(return_outputs, a label smoother or compute_loss_func), which the tiled "
                "loss does not make; the plain loss runs"
            )
        return model
    return TiledLoss(trainer.engine, tiles)
