"""Activation memory of a decoder-only transformer at a micro-batch: computed, not measured.

The figures follow what autograd keeps and what the kernels allocate, tensor by tensor, for the
two model families the rehearsal runs (and measured there, ``tests/test_activation_estimate``):

- ``"llama"``: Hugging Face decoders of the Llama kind (Llama, Mistral, Qwen2/3): RMSNorm in
  fp32 (it keeps its fp32 input, the cast and its output), rotary positions, a gated MLP
  (gate, up, their product and the activation kept: 4 tensors of the MLP's width), SDPA as a
  GPU runs it (flash: the queries, keys, values and output kept, a float32 log-sum-exp row
  per head; no ``s²`` scores), the loss on logits upcast to fp32 as ``ForCausalLMLoss`` does.
- ``"gpt"``: the benchmark GPT of :mod:`zero_offload.bench.gpt` (LayerNorm, a 4h GELU MLP,
  tied embeddings).

The peak is the largest of a few moments, each the bytes alive at once there:

- the loss (``loss``): the forward's log-softmax (logits in the compute dtype, their fp32
  copy, the fp32 log-probabilities) or the backward's (log-probabilities, their gradient and
  the logits' gradient: 12 bytes a logit) — nothing of stage 3 is gathered then, no
  gradient is being reduced;
- the head's backward (``head``): the logits' gradient in fp32 and in the compute dtype with
  the head's weight gradient — stage 3 holds the head gathered, nothing is reduced yet;
- the layers (``running``): one decoder layer's saved tensors (all of them, recomputed,
  under checkpointing), the gradient coming in and the MLP's gradients — beside stage 3's
  gathered window and the gradient reductions in flight.

Both sit on what the layers keep: with activation checkpointing each layer's input
(``tokens × hidden`` in the compute dtype), else every layer's saved tensors. Activation
offload (``offload_activations="checkpoints"``) moves the kept inputs to host buffers
(``activations.host_slots.slot_bytes`` each) and leaves ``offload_activations_prefetch`` of
them on the device (one more in backward, the one in use). The tiled loss (``tiled_loss``)
computes the loss ``tile`` tokens at a time: the logits of one tile exist at once, and the
slices' gradients are added into a full-size buffer of the hidden states' gradient; its
tiles are checkpointed regions, so with offload their input, the last hidden states, goes to
the host too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...activations.config import ActivationConfig
from ...activations.host_slots import slot_bytes
from .terms import ACTIVATIONS, FORWARD_BACKWARD, LOSS, RESIDENT, Term

__all__ = ["DecoderShape", "ActivationEstimate", "estimate_activations", "FAMILIES"]

FAMILIES = ("llama", "gpt")
# Hugging Face model types laid out as Llama is (the "llama" family's arithmetic holds)
_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_FP32 = 4


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder's activations depend on: its sizes and its family (``FAMILIES``)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    family: str = "llama"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r}: expected one of {', '.join(FAMILIES)}")

    @classmethod
    def of(cls, model: Any) -> "DecoderShape | None":
        """The shape of a Hugging Face Llama-kind model (or its config) or a benchmark
        ``GPT`` (or its ``GPTConfig``); None for any other model, whose activations the
        planner cannot compute (give ``activation_bytes``, or rehearse it)."""
        from ...bench.gpt import GPT, GPTConfig

        cfg = model.cfg if isinstance(model, GPT) else getattr(model, "config", model)
        if isinstance(cfg, GPTConfig):
            return cls(
                cfg.layers, cfg.width, 4 * cfg.width, cfg.heads, cfg.heads,
                cfg.width // cfg.heads, cfg.vocab, "gpt",
            )  # fmt: skip
        if getattr(cfg, "model_type", None) not in _LLAMA_TYPES:
            return None
        heads = cfg.num_attention_heads
        return cls(
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            heads,
            getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            cfg.vocab_size,
        )


@dataclass(frozen=True)
class ActivationEstimate:
    """Device bytes of the activations at their three kinds of moments, and the host bytes
    of their offload buffers. ``running``: the largest while the layers run (stage 3's
    gathered window and gradient reductions are alive beside it); ``head``: the head's
    backward (the head's unit gathered beside it); ``loss``: the largest at the loss.
    ``moments``: every moment's bytes, by name."""

    running: int
    head: int
    loss: int
    host: int
    moments: dict[str, int]
    tokens: int
    checkpointing: bool
    offload: bool
    tile_tokens: int  # 0: the plain loss

    @property
    def device_bytes(self) -> int:
        """The activations' peak on the device."""
        return max(self.running, self.head, self.loss)

    def terms(self, head_gathered: int = 0) -> list[Term]:
        """The estimate's terms: the layers' figure (beside the gathered window and the
        reductions), the loss's or the head's backward with the head's unit gathered
        (``head_gathered`` bytes: stage 3), whichever is more, and the offload buffers."""
        what = f"{self.tokens} tokens, {self.describe()}"
        at_head = self.head + head_gathered
        out = [
            Term(
                "activations",
                "device",
                FORWARD_BACKWARD,
                ACTIVATIONS,
                self.running,
                f"{what}: a decoder layer's backward",
            ),
            Term(
                "activations at the loss",
                "device",
                LOSS,
                ACTIVATIONS,
                max(self.loss, at_head),
                f"{what}: the log-softmax's logits"
                if self.loss >= at_head
                else f"{what}: the head's backward, with its unit gathered",
            ),
        ]
        if self.host:
            out.append(
                Term(
                    "offloaded activations",
                    "host",
                    RESIDENT,
                    ACTIVATIONS,
                    self.host,
                    "each checkpointed layer's input, in host buffers reused step to step",
                )
            )
        return out

    def describe(self) -> str:
        """'checkpointing, activation offload, tiled loss (4096 tokens)' or 'none'."""
        parts = []
        if self.checkpointing:
            parts.append("checkpointing")
        if self.offload:
            parts.append("activation offload")
        if self.tile_tokens:
            parts.append(f"tiled loss ({self.tile_tokens} tokens)")
        return ", ".join(parts) or "no checkpointing"


def _dtype_bytes(dtype: torch.dtype | str) -> int:
    from ...config import compute_dtype

    return torch.empty(0, dtype=compute_dtype(dtype)).element_size()


def _norm_kept(shape: DecoderShape, b: int) -> int:
    """Per token, what a final norm keeps for backward (RMSNorm: fp32 input, the cast back
    unless already fp32, the output; LayerNorm: input, output, mean and rstd)."""
    h = shape.hidden
    if shape.family == "gpt":
        return 2 * b * h + 2 * _FP32
    return _FP32 * h + (b * h if b < _FP32 else 0) + b * h


def _layer_kept(shape: DecoderShape, b: int) -> int:
    """Per token, what one decoder layer keeps for backward without checkpointing."""
    h, a = shape.hidden, shape.heads
    lse = _FP32 * a  # the fused kernel's log-sum-exp row per head
    if shape.family == "gpt":
        # two LayerNorms (input and output), q/k/v, the attention output, the MLP's two 4h
        return 16 * b * h + lse + 4 * _FP32
    q, kv = a * shape.head_dim, shape.kv_heads * shape.head_dim
    return 2 * _norm_kept(shape, b) + 2 * b * q + 2 * b * kv + 4 * b * shape.intermediate + lse


def _layer_transient(shape: DecoderShape, b: int, backward: bool) -> int:
    """Per token, what a layer allocates while it runs beyond what it keeps: backward, the
    gradient coming in and the MLP's gradients; forward under checkpointing (nothing kept),
    the MLP's intermediates and the residual stream."""
    h, f = shape.hidden, shape.intermediate
    if shape.family == "gpt":
        # measured on the simulated GPU at 13B's width: the MLP's 4h gradients, fp32 dQ
        return (15 * b * h) // 2 if backward else 13 * b * h
    return b * h + 2 * b * f if backward else 3 * b * f + 3 * b * h


def estimate_activations(
    shape: DecoderShape,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype | str = torch.bfloat16,
    checkpointing: bool = False,
    activations: ActivationConfig | None = None,
) -> ActivationEstimate:
    """The activations of one ``batch × seq`` micro-batch on one GPU (see the module's
    docstring for what each moment holds). ``activations``: the offload and tiled-loss
    settings (``ZeroConfig.activations``; default: neither). Offloading every saved tensor
    (``offload_activations="all"``) is not estimated: rehearse it."""
    cfg = activations or ActivationConfig()
    if cfg.mode == "all":
        raise ValueError(
            "offload_activations='all' is not estimated by the planner: rehearse it "
            "(zero-offload rehearse --offload-activations all) or use 'checkpoints'"
        )
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got {batch} and {seq}")
    b = _dtype_bytes(dtype)
    T, L, h, V = batch * seq, shape.layers, shape.hidden, shape.vocab
    u = b * h * T  # one hidden state
    offload = checkpointing and cfg.offload
    # what the layers keep: at the forward's end and the loss, and in a layer's backward
    if not checkpointing:
        kept_f = kept_b = kept_layer = L * _layer_kept(shape, b) * T
    elif offload:
        kept_f = kept_b = min(L, cfg.prefetch) * u
        kept_layer = min(L, cfg.prefetch + 1) * u
    else:
        kept_f = kept_b = kept_layer = L * u
    rope = 2 * b * shape.head_dim * T if shape.family == "llama" else 0
    norm = _norm_kept(shape, b) * T
    upcast = _FP32 if b < _FP32 else 0  # the loss's fp32 copy of 16-bit logits
    tile = min(cfg.tiled_loss, T) if cfg.tiled_loss else T
    tiled = tile < T
    # one tile's logits (all of them with the plain loss)
    loss_f = (b + upcast + _FP32) * tile * V
    loss_b = 3 * _FP32 * tile * V  # log-probs, their gradient, the logits' gradient
    head_w = V * h * b  # the head's weight gradient, before the engine takes it
    moments = {
        "forward: the loss": kept_f + rope + norm + loss_f,
        "backward: the loss": kept_b + rope + norm + loss_b + (2 * u + head_w if tiled else 0),
        "backward: a layer": kept_layer
        + rope
        + (_layer_kept(shape, b) * T if checkpointing else 0)
        + _layer_transient(shape, b, backward=True) * T,
    }
    if not tiled:  # the logits' gradient, fp32 and in the compute dtype, into the head
        moments["backward: the head"] = kept_b + rope + norm + (upcast + b) * T * V + u + head_w
    if checkpointing:
        moments["forward: a layer"] = kept_f + rope + _layer_transient(shape, b, False) * T
    else:
        moments["forward: the final norm"] = kept_f + rope + norm + (_FP32 + b) * h * T
    loss = max(moments["forward: the loss"], moments["backward: the loss"])
    # the tiled loss runs the head in every tile's backward: the head is gathered then
    head = moments["backward: the loss"] if tiled else moments["backward: the head"]
    running = max(v for k, v in moments.items() if not k.endswith(("the loss", "the head")))
    # the tiles are checkpointed regions too: their input (the last hidden states) is offloaded
    host = (L + (1 if tiled else 0)) * slot_bytes(u) if offload else 0
    return ActivationEstimate(
        running=int(running),
        head=int(head),
        loss=int(loss),
        host=int(host),
        moments={k: int(v) for k, v in moments.items()},
        tokens=T,
        checkpointing=checkpointing,
        offload=offload,
        tile_tokens=tile if tiled else 0,
    )
