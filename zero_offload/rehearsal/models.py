"""Models to rehearse: Hugging Face configs built on the meta device, and the fix-ups that let
any meta model through the engine under fake tensors.

Built-in names are the Llama 2 shapes (``llama-7b``, ``llama-13b``, ``llama-70b``); any folder
with a ``config.json`` works too (``AutoModelForCausalLM.from_config``; ``transformers`` is
imported only then).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn as nn

__all__ = ["PRESETS", "build_model", "prepare_meta_model", "causal_lm_batch"]

# Llama 2 (Touvron et al., 2023), as in the released config.json files.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
    ),
    "llama-13b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
    ),
    "llama-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
}
_LLAMA_COMMON: dict[str, Any] = dict(
    vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False
)


def build_model(name_or_path: str, *, checkpointing: bool = False) -> nn.Module:
    """A causal LM on the meta device from a built-in name or a folder with ``config.json``;
    ``checkpointing`` turns on the model's activation checkpointing."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - an optional dependency
        raise RuntimeError(
            "rehearsing a Hugging Face config needs transformers (pip install transformers)"
        ) from exc
    if name_or_path in PRESETS:
        config = transformers.LlamaConfig(**_LLAMA_COMMON, **PRESETS[name_or_path])
    elif os.path.isfile(os.path.join(name_or_path, "config.json")):
        with open(os.path.join(name_or_path, "config.json")) as f:
            json.load(f)  # a clear error for a broken file before transformers reads it
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: give one of "
            f"{', '.join(PRESETS)} or a folder holding a config.json"
        )
    config.use_cache = False
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    model.train()
    return model


def _no_values() -> None:
    """A rehearsal needs a parameter's shape, not its values."""


def prepare_meta_model(model: nn.Module) -> None:
    """Let a meta model through ``initialize`` under fake tensors: a module that holds meta
    parameters but has no ``reset_parameters`` (e.g. an RMSNorm) gets one that sets nothing,
    and meta buffers (e.g. rotary frequencies) become fake host tensors of the same shape."""
    for module in model.modules():
        own_meta = any(p.is_meta for p in module.parameters(recurse=False))
        if own_meta and not callable(getattr(module, "reset_parameters", None)):
            # torch types Module.__setattr__ for tensors and modules only; a function is fine
            module.reset_parameters = _no_values  # type: ignore[assignment]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


def causal_lm_batch(batch: int, seq: int) -> dict[str, torch.Tensor]:
    """Token ids and labels of a ``batch × seq`` micro-batch (values do not matter)."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}
