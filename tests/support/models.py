"""Small models for the equivalence tests: an MLP, a GPT-style LM with tied embeddings, the
same with activation checkpointing, and a net that calls one block twice."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero_offload.bench.gpt import GPT, GPTConfig

VOCAB, SEQ, WIDTH = 64, 8, 32


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TwiceNet(nn.Module):
    """One block used twice in a forward (its parameters are needed twice in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.block(h)
        h = self.block(h) + h
        return self.out(h)


def TinyGPT(layers: int = 2, width: int = WIDTH, heads: int = 2, checkpoint: bool = False) -> GPT:
    """The library's GPT-style LM at toy size; its output projection is tied to the token
    embedding, and ``checkpoint`` recomputes each block in backward."""
    return GPT(
        GPTConfig(
            layers=layers, width=width, heads=heads, vocab=VOCAB, seq=SEQ, checkpoint=checkpoint
        )
    )


def make(name: str) -> nn.Module:
    return {
        "mlp": MLP,
        "gpt": TinyGPT,
        "gpt_ckpt": lambda: TinyGPT(checkpoint=True),
        "twice": TwiceNet,
    }[name]()


def batch(name: str, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of n samples: (inputs, targets)."""
    if name.startswith("gpt"):
        idx = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
        return idx[:, :-1], idx[:, 1:]
    return torch.randn(n, 16, generator=gen), torch.randn(n, 8, generator=gen)


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name.startswith("gpt"):
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out.float(), target.float())
