"""Small models for the equivalence tests: an MLP, a GPT-style LM with tied embeddings, the
same with activation checkpointing, and a net that calls one block twice."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

VOCAB, SEQ, WIDTH = 64, 8, 32


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                                 nn.Linear(32, 8))

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


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-style causal LM; the output projection is tied to the token embedding."""

    def __init__(self, layers: int = 2, width: int = WIDTH, heads: int = 2,
                 checkpoint: bool = False) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(SEQ, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def make(name: str) -> nn.Module:
    return {"mlp": MLP, "gpt": TinyGPT, "gpt_ckpt": lambda: TinyGPT(checkpoint=True),
            "twice": TwiceNet}[name]()


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
