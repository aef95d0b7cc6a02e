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


def build_model(
    name_or_path: str, *, checkpointing: bool = False, attention: str = "auto"
) -> nn.Module:
    """A causal LM on the meta device from a built-in name or a folder with ``config.json``;
    ``checkpointing`` turns on the model's activation checkpointing. Its attention is
    Hugging Face's SDPA, as it runs on a GPU (the rehearsal then counts the GPU's kernel:
    ``rehearsal.attention``), or the model's eager code with ``attention="eager"``; a model
    that has no SDPA implementation keeps its eager one."""
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
    implementation = "eager" if attention == "eager" else _sdpa_without_mask(transformers)
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=implementation
            )
        except ValueError:  # this architecture has no SDPA attention: it runs eager on a GPU
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="eager"
            )
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


_SDPA = "zero_offload_rehearsal_sdpa"


def _sdpa_without_mask(transformers: Any) -> str:
    """Hugging Face's own SDPA attention, under a name whose mask function passes no mask
    for a batch without a padding mask.

    On a GPU, HF gives SDPA no mask for a batch without padding or packing (``is_causal``
    instead), so that the flash kernel can run. Under fake tensors it cannot read the
    position ids that tell it the batch is not packed, and builds an ``s × s`` boolean
    mask, which would send SDPA to the memory-efficient kernel with an ``s²`` bias. A
    rehearsal's batch (``causal_lm_batch``) has neither padding nor packing. A batch with
    an ``attention_mask`` gets HF's SDPA mask, as a padded batch does on a GPU."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attention_mask") is None:
            return None
        return sdpa_mask(*args, **kwargs)

    transformers.AttentionInterface.register(_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(_SDPA, mask)
    return _SDPA


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
