"""The encoder-only model: embeddings, positions and a stack of encoder layers over one vocabulary
(:class:`EncoderModel`), built from the Transformer's own parts (:mod:`qkv.models.transformer`).

Shape legend: ``b`` batch, ``s`` length, ``d`` d_model, ``h`` heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from qkv.models import transformer
from qkv.models.options import check_fits_weights
from qkv.models.transformer import Encoder, TokenEmbedding, TransformerConfig, _init_weights
from qkv.nn.positional import build_positional_encoding


@dataclass
class EncoderModelOutput:
    """What :class:`EncoderModel` returns: the final hidden states and, if asked, every layer's weights."""

    last_hidden_state: Tensor  # (b, s, d)
    attentions: list[Tensor] | None = None  # per layer (b, h, s, s)


class EncoderModel(nn.Module):
    """Encoder-only model: embeddings, positions and ``num_encoder_layers`` encoder layers over
    ``src_vocab_size`` tokens. Returns hidden states (add a head for a task)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        check_fits_weights(config.matrix_parameters(encoder_only=True))
        self.config = config
        positional = build_positional_encoding(config.positional, config.d_model, config.max_len)
        self.embed = TokenEmbedding(
            nn.Embedding(config.src_vocab_size, config.d_model), positional, config.d_model, config.dropout
        )
        self.encoder = Encoder(config, config.num_encoder_layers)
        _init_weights(self, config.d_model, config.pad_id)

    def forward(
        self, ids: Tensor, *, key_padding_mask: Tensor | None = None, need_weights: bool = False
    ) -> EncoderModelOutput:
        """Encode ``ids (b, s)``; ``key_padding_mask`` (True = real token) defaults to ``ids != pad_id``."""
        if key_padding_mask is None:
            key_padding_mask = ids != self.config.pad_id
        hidden, attentions = self.encoder(self.embed(ids), key_padding_mask=key_padding_mask, need_weights=need_weights)
        return EncoderModelOutput(hidden, attentions)


# qkv 1.x's path, qkv.models.transformer.EncoderModel: set from here, so that the arrow runs one way (the
# package's __init__ imports this module before anything can ask the old path).
transformer.EncoderModel = EncoderModel  # type: ignore[attr-defined]
transformer.EncoderModelOutput = EncoderModelOutput  # type: ignore[attr-defined]
