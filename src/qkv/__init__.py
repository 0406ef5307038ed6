"""qkv: the attention of "Attention Is All You Need", built to be trained, inspected and trusted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv.attention import (
    AttentionOutput,
    KVCache,
    MultiHeadAttention,
    attention_reference,
    causal_mask,
    combine_masks,
    padding_mask_from_ids,
    padding_mask_from_lengths,
    scaled_dot_product_attention,
    use_backend,
)
from qkv.models.causal_lm import CausalLM, CausalLMConfig, CausalLMOutput
from qkv.models.encoder_model import EncoderModel
from qkv.models.transformer import (
    DecoderOutput,
    EncoderOutput,
    Transformer,
    TransformerConfig,
)
from qkv.nn.dropout import Dropout
from qkv.nn.layers import DecoderLayer, EncoderLayer, FeedForward, LayerOutput
from qkv.nn.positional import LearnedPositionalEncoding, SinusoidalPositionalEncoding, sinusoidal_table

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from qkv.pretrained import BertEncoder, PretrainedCausalLM, PretrainedTransformer

__version__ = "2.0.0"  # the one source of the version: pyproject.toml reads it at build time


def load_pretrained(
    path: str | Path, *, device: str | torch.device | None = None
) -> BertEncoder | PretrainedCausalLM | PretrainedTransformer:
    """Load a Hugging Face BERT-family or GPT-2 checkpoint folder, or a Marian folder ``qkv export --to hf``
    wrote, into qkv's own model (see :mod:`qkv.pretrained`)."""
    from qkv.pretrained import load_pretrained as _load  # here: it imports the tokenizers library

    return _load(path, device=device)


__all__ = [
    "AttentionOutput",
    "CausalLM",
    "CausalLMConfig",
    "CausalLMOutput",
    "DecoderLayer",
    "DecoderOutput",
    "Dropout",
    "EncoderLayer",
    "EncoderModel",
    "EncoderOutput",
    "FeedForward",
    "KVCache",
    "LayerOutput",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "SinusoidalPositionalEncoding",
    "Transformer",
    "TransformerConfig",
    "attention_reference",
    "causal_mask",
    "combine_masks",
    "load_pretrained",
    "padding_mask_from_ids",
    "padding_mask_from_lengths",
    "scaled_dot_product_attention",
    "sinusoidal_table",
    "use_backend",
]
