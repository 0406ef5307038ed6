"""Attention: the eager reference, the fused fast path, masks (and mask functions, :mod:`.mask_functions`)
and multi-head attention."""

from qkv.attention import mask_functions
from qkv.attention.backends import BackendChoice, select_backend, use_backend
from qkv.attention.functional import attention_reference, masked_softmax, scaled_dot_product_attention
from qkv.attention.masks import (
    as_additive,
    causal_mask,
    combine_masks,
    padding_mask_from_ids,
    padding_mask_from_lengths,
)
from qkv.attention.multihead import AttentionOutput, KVCache, MultiHeadAttention

__all__ = [
    "AttentionOutput",
    "BackendChoice",
    "KVCache",
    "MultiHeadAttention",
    "as_additive",
    "attention_reference",
    "causal_mask",
    "combine_masks",
    "mask_functions",
    "masked_softmax",
    "padding_mask_from_ids",
    "padding_mask_from_lengths",
    "scaled_dot_product_attention",
    "select_backend",
    "use_backend",
]
