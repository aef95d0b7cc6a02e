"""A plain GPT-style causal LM (pre-norm blocks, tied embeddings) for benchmarks and examples.

Sizes are set by :class:`GPTConfig`; ``GPTConfig.preset("13b")`` gives the 13B architecture
(40 layers, width 5120, 40 heads) that the examples scale down to fit a small machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

__all__ = ["GPTConfig", "GPT", "synthetic_batch"]


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 2
    width: int = 64
    heads: int = 4
    vocab: int = 256
    seq: int = 32
    checkpoint: bool = False  # recompute each block in backward (activation checkpointing)

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}")
        return replace(_PRESETS[name], **overrides)

    @property
    def num_params(self) -> int:
        block = 12 * self.width**2 + 13 * self.width
        return self.layers * block + (self.vocab + self.seq) * self.width + 2 * self.width


_PRESETS = {
    "tiny": GPTConfig(layers=2, width=64, heads=4, vocab=256, seq=32),
    "small": GPTConfig(layers=6, width=384, heads=6, vocab=8192, seq=128),
    "1b": GPTConfig(layers=24, width=2048, heads=16, vocab=32000, seq=2048),
    "2.7b": GPTConfig(layers=32, width=2560, heads=32, vocab=32000, seq=2048),
    "13b": GPTConfig(layers=40, width=5120, heads=40, vocab=32000, seq=2048),
}


class Linear(nn.Linear):
    """GPT-2's init, N(0, 0.02) weights and zero bias, kept in ``reset_parameters`` so that a
    model built on the meta device and materialized unit by unit starts the same way."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = Linear(cfg.width, 3 * cfg.width)
        self.proj = Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = Linear(cfg.width, 4 * cfg.width)
        self.fc_out = Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab, cfg.width)
        self.wpe = Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.lm_head = Linear(cfg.width, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when ``targets`` are given."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def synthetic_batch(
    cfg: GPTConfig, batch: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets drawn from a fixed random sequence (learnable)."""
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=generator)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
