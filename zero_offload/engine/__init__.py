"""The training engine around a user's ``nn.Module``: ``initialize`` builds it from the parts
below (params, grads, update), and it is the public face for the loop, checkpoints and
trainers."""

from .engine import Engine, initialize, persistent_buffers

__all__ = ["Engine", "initialize", "persistent_buffers"]
