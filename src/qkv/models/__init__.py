"""The models: the encoder-decoder :class:`Transformer` of the paper (and its encoder alone, for
BERT), and the decoder-only :class:`CausalLM`. Each file reads top to bottom, its config beside it."""

from qkv.models.causal_lm import CausalLM, CausalLMConfig, CausalLMOutput
from qkv.models.encoder_model import EncoderModel
from qkv.models.transformer import (
    DecoderOutput,
    EncoderOutput,
    Transformer,
    TransformerConfig,
)

__all__ = [
    "CausalLM",
    "CausalLMConfig",
    "CausalLMOutput",
    "DecoderOutput",
    "EncoderModel",
    "EncoderOutput",
    "Transformer",
    "TransformerConfig",
]
