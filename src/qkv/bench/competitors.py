"""The models qkv is timed against, built with the same sizes as a qkv :class:`~qkv.Transformer`.

* :class:`TorchTransformerMT`: ``torch.nn.Transformer`` with the same embeddings (one shared table
  scaled by sqrt(d_model)), sinusoidal positions, dropout, tied output projection and final norms
  as qkv's model: with copied weights it computes the same logits (tested).
* :func:`build_marian`: Hugging Face ``MarianMTModel``, randomly initialised, with the same sizes,
  post-LN, ReLU, scaled and shared embeddings and tied output (transformers is imported lazily).

Every wrapper is called as ``model(src, tgt_in) -> logits (b, s_tgt, V)`` with right-padded ids, so
one training step and one loss serve every contender. The work is kept the same: residual,
embedding and feed-forward dropout as configured, and no dropout on the attention weights (qkv's
``attention_dropout`` default; ``nn.Transformer`` would otherwise apply its dropout there too,
forcing the slower non-fused attention kernel).

Shape legend: ``b`` batch, ``s_src`` / ``s_tgt`` lengths, ``d`` d_model, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from qkv.models.transformer import TransformerConfig
from qkv.nn.positional import sinusoidal_table

if TYPE_CHECKING:  # transformers is imported only where a Marian model is built
    from transformers import MarianConfig, MarianMTModel


class TorchTransformerMT(nn.Module):
    """``torch.nn.Transformer`` wrapped as a translation model of the same shape as qkv's.

    Args:
        config: the qkv config to mirror (sizes, dropout, activation, norm placement, pad id).
            Needs ``share_embeddings`` (one joint vocabulary), as in the Multi30k model.
    """

    positions: Tensor  # (max_len, d) sinusoidal table, a buffer

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.src_vocab_size != config.tgt_vocab_size:
            raise ValueError(
                f"TorchTransformerMT needs one joint vocabulary, got src_vocab_size={config.src_vocab_size}, "
                f"tgt_vocab_size={config.tgt_vocab_size}"
            )
        self.pad_id = config.pad_id
        self.scale = math.sqrt(config.d_model)
        self.embedding = nn.Embedding(config.src_vocab_size, config.d_model)
        self.register_buffer("positions", sinusoidal_table(config.max_len, config.d_model), persistent=False)
        self.dropout = nn.Dropout(config.dropout)
        layer_kwargs: dict[str, Any] = dict(  # the same for the encoder's and the decoder's layers
            d_model=config.d_model,
            nhead=config.num_heads,
            dim_feedforward=config.d_ff,
            dropout=config.dropout,
            activation=config.activation if config.activation in ("relu", "gelu") else "gelu",
            layer_norm_eps=config.layer_norm_eps,
            batch_first=True,
            norm_first=config.norm_first,
            bias=config.bias,
        )

        def final_norm() -> nn.LayerNorm | None:  # qkv's post-LN stacks end without one, as the paper's
            return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None

        self.transformer = nn.Transformer(
            d_model=config.d_model,
            nhead=config.num_heads,
            custom_encoder=nn.TransformerEncoder(
                nn.TransformerEncoderLayer(**layer_kwargs),
                config.num_encoder_layers,
                norm=final_norm(),
                enable_nested_tensor=False,
            ),
            custom_decoder=nn.TransformerDecoder(
                nn.TransformerDecoderLayer(**layer_kwargs), config.num_decoder_layers, norm=final_norm()
            ),
            batch_first=True,
        )
        for module in self.transformer.modules():  # attention-weight dropout as in qkv's config
            if isinstance(module, nn.MultiheadAttention):
                module.dropout = config.attention_dropout
        self.output_proj = nn.Linear(config.d_model, config.tgt_vocab_size, bias=False)
        nn.init.normal_(self.embedding.weight, std=config.d_model**-0.5)
        self.output_proj.weight = self.embedding.weight

    def _embed(self, ids: Tensor) -> Tensor:
        return self.dropout(self.embedding(ids) * self.scale + self.positions[: ids.size(1)])  # (b, s, d)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher-forced logits ``(b, s_tgt, V)`` for ``src (b, s_src)`` and ``tgt (b, s_tgt)``."""
        src_is_pad = src == self.pad_id  # torch's convention: True = ignore
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)  # (s_tgt, s_tgt)
        hidden = self.transformer(
            self._embed(src),
            self._embed(tgt),
            tgt_mask=causal,
            src_key_padding_mask=src_is_pad,
            memory_key_padding_mask=src_is_pad,
            tgt_is_causal=True,
        )
        return self.output_proj(hidden)  # (b, s_tgt, V)


class MarianMT(nn.Module):
    """A Hugging Face ``MarianMTModel`` called like qkv's model: ``model(src, tgt_in) -> logits``."""

    def __init__(self, model: MarianMTModel, pad_id: int) -> None:
        super().__init__()
        self.model = model
        self.pad_id = pad_id

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Logits ``(b, t, V)`` of the HF model for sources ``src (b, s)`` and decoder inputs ``tgt (b, t)``."""
        attention_mask = (src != self.pad_id).long()  # (b, s_src), HF convention: 1 = real token
        output = self.model(input_ids=src, attention_mask=attention_mask, decoder_input_ids=tgt, use_cache=False)
        return output.logits


def marian_config(config: TransformerConfig, *, bos_id: int, eos_id: int) -> MarianConfig:
    """A ``transformers.MarianConfig`` with the sizes of ``config``."""
    try:
        from transformers import MarianConfig
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ValueError("the MarianMT comparison needs transformers: pip install 'qkv[test]'") from err
    if config.src_vocab_size != config.tgt_vocab_size:
        raise ValueError(
            f"MarianMT here shares one vocabulary, got {config.src_vocab_size} and {config.tgt_vocab_size}"
        )
    return MarianConfig(
        vocab_size=config.src_vocab_size,
        decoder_vocab_size=config.tgt_vocab_size,
        d_model=config.d_model,
        encoder_layers=config.num_encoder_layers,
        decoder_layers=config.num_decoder_layers,
        encoder_attention_heads=config.num_heads,
        decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function=config.activation if config.activation in ("relu", "gelu") else "gelu_new",
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.dropout,  # qkv's FeedForward drops after the activation too
        max_position_embeddings=config.max_len,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=config.tie_output,
        pad_token_id=config.pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        decoder_start_token_id=bos_id,
        forced_eos_token_id=None,
    )


def build_marian(config: TransformerConfig, *, bos_id: int, eos_id: int) -> MarianMT:
    """A randomly initialised ``MarianMTModel`` with ``config``'s sizes, wrapped as :class:`MarianMT`.

    Args:
        config: the qkv config to mirror.
        bos_id, eos_id: the tokenizer's start/end ids (Marian's decoder start and EOS).

    Returns:
        :class:`MarianMT`; the Hugging Face model is its ``.model``.
    """
    from transformers import MarianMTModel

    return MarianMT(MarianMTModel(marian_config(config, bos_id=bos_id, eos_id=eos_id)), config.pad_id)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, tied tensors counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
