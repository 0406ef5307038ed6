"""The encoder-decoder Transformer built from qkv's layers (the encoder-only model is
:mod:`qkv.models.encoder_model`, the decoder-only language model :mod:`qkv.models.causal_lm`).
Reads top to bottom.

Shape legend: ``b`` batch, ``s_src`` source length, ``s_tgt`` target length, ``d`` d_model,
``V`` vocabulary size, ``h`` heads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from qkv.attention.multihead import KVCache
from qkv.models.options import check_fits_weights, check_model_options
from qkv.nn.dropout import Dropout
from qkv.nn.feedforward import GATED
from qkv.nn.layers import DecoderLayer, EncoderLayer
from qkv.nn.loss import fused_linear_cross_entropy
from qkv.nn.norms import NORMS, build_norm
from qkv.nn.positional import build_positional_encoding
from qkv.runtime.fileio import read_json, write_json


@dataclass
class TransformerConfig:
    """Sizes and options of a qkv model. Defaults are the paper's base model (Table 3)."""

    src_vocab_size: int = 32000  # source vocabulary (also the vocabulary of EncoderModel)
    tgt_vocab_size: int = 32000  # target vocabulary
    d_model: int = 512  # model width (d_model)
    num_heads: int = 8  # attention heads (h); d_model must be divisible by it
    num_encoder_layers: int = 6  # encoder layers (N)
    num_decoder_layers: int = 6  # decoder layers (N)
    d_ff: int = 2048  # inner width of the feed-forward network (d_ff)
    dropout: float = 0.1  # residual and embedding dropout (P_drop, section 5.4)
    attention_dropout: float = 0.0  # dropout on attention weights (not used in the paper)
    activation: str = "relu"  # feed-forward activation: relu (paper), gelu or gelu_tanh
    norm_first: bool = False  # pre-LN (True) or the paper's post-LN (False)
    layer_norm_eps: float = 1e-5  # LayerNorm epsilon
    max_len: int = 1024  # longest sequence the positional table covers
    positional: str = "sinusoidal"  # sinusoidal (section 3.5), learned, or none
    share_embeddings: bool = False  # one embedding table for source and target (joint vocabulary)
    tie_output: bool = True  # output projection shares the target embedding (section 3.4)
    pad_id: int = 0  # padding token id; masks are derived from it when not given
    bias: bool = True  # biases in attention and feed-forward projections
    norm: str = "layer"  # the layers' norms: layer (LayerNorm, the paper) or rms (RMSNorm)
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: num_heads

    # Fields added in qkv 2.0, whose defaults are the model every earlier run folder holds: a config.json
    # without them is an older run, not a damaged one (qkv.inference.runs.read_model_config).
    OPTIONAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"norm", "num_kv_heads"})

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        kv = self.num_kv_heads
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or self.num_heads % kv):
            raise ValueError(f"num_kv_heads must be a positive divisor of num_heads ({self.num_heads}), got {kv!r}")
        check_model_options(
            self,
            (
                "src_vocab_size",
                "tgt_vocab_size",
                "d_model",
                "num_heads",
                "d_ff",
                "max_len",
                "num_encoder_layers",
                "num_decoder_layers",
            ),
        )
        if not 0 <= self.pad_id < max(self.src_vocab_size, self.tgt_vocab_size):
            raise ValueError(f"pad_id {self.pad_id} is outside the vocabulary")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "share_embeddings needs one vocabulary, got "
                f"src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size}"
            )

    def matrix_parameters(self, *, encoder_only: bool = False) -> int:
        """The values of the model's weight matrices, embeddings and positional table, counted from
        the sizes without building anything (biases and layer norms left out: a lower bound of its
        size, which :func:`~qkv.models.options.check_fits` compares with the memory).

        Args:
            encoder_only: count :class:`EncoderModel` (embedding and encoder) instead of the
                encoder-decoder :class:`Transformer`.

        Returns:
            The count.
        """
        d, ff = self.d_model, self.d_ff * (3 if self.activation in GATED else 2)  # a gate: a third product
        kv = d if self.num_kv_heads is None else self.num_kv_heads * (d // self.num_heads)
        table = 0 if self.positional == "none" else self.max_len * d
        attention = 2 * d * d + 2 * d * kv
        encoder = self.num_encoder_layers * (attention + d * ff)
        if encoder_only:
            return self.src_vocab_size * d + table + encoder
        embeddings = self.src_vocab_size * d + (0 if self.share_embeddings else self.tgt_vocab_size * d)
        output = 0 if self.tie_output else self.tgt_vocab_size * d
        tables = 2 * table if self.positional == "learned" else table  # a learned table per side
        return embeddings + output + tables + encoder + self.num_decoder_layers * (2 * attention + d * ff)

    def layer_kwargs(self) -> dict:
        """The arguments every EncoderLayer/DecoderLayer of this model is built with."""
        return dict(
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            activation=self.activation,
            norm_first=self.norm_first,
            layer_norm_eps=self.layer_norm_eps,
            bias=self.bias,
            norm=self.norm,
            num_kv_heads=self.num_kv_heads,
        )

    def to_json(self, path: str | Path) -> None:
        """Write the config to ``path`` as JSON, atomically (:func:`qkv.runtime.fileio.write_json`)."""
        write_json(path, asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
        """The config whose fields are ``data`` (:meth:`to_json`'s content); a key that is no field is a ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {unknown}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | Path) -> TransformerConfig:
        """The config in the JSON file ``path`` (:meth:`to_json`'s output), checked as :meth:`from_dict` checks it."""
        return cls.from_dict(read_json(path))


@dataclass
class EncoderOutput:
    """What :meth:`Transformer.encode` returns: the memory, per-layer weights if asked, the source padding mask."""

    hidden: Tensor  # (b, s_src, d) encoder output ("memory")
    attentions: list[Tensor] | None = None  # per layer (b, h, s_src, s_src)
    key_padding_mask: Tensor | None = None  # (b, s_src) True = real token


@dataclass
class DecoderOutput:
    """What :meth:`Transformer.decode` returns: logits, final states, weights if asked, the next step's cache."""

    logits: Tensor | None  # (b, s_tgt, V); None from decode(..., project=False)
    hidden: Tensor  # (b, s_tgt, d) final decoder states
    self_attentions: list[Tensor] | None = None  # per layer (b, h, s_tgt, s_k)
    cross_attentions: list[Tensor] | None = None  # per layer (b, h, s_tgt, s_src)
    cache: list[tuple[KVCache, KVCache]] | None = field(default=None, repr=False)  # per layer (self, cross)


class TokenEmbedding(nn.Module):
    """Token embedding scaled by sqrt(d_model) (section 3.4), then position, then dropout."""

    def __init__(self, embedding: nn.Embedding, positional: nn.Module, d_model: int, dropout: float) -> None:
        super().__init__()
        self.embedding = embedding
        self.positional = positional
        self.scale = math.sqrt(d_model)
        self.dropout = Dropout(dropout)

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        """``ids (b, s)`` integer ids at positions ``start ..`` (after a cache's tokens) -> ``(b, s, d)``."""
        if ids.dim() != 2:
            raise ValueError(f"token ids must be (batch, seq), got shape {tuple(ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        return self.dropout(self.positional(self.embedding(ids) * self.scale, start))  # (b, s, d)


class Encoder(nn.Module):
    """A stack of EncoderLayers; a final LayerNorm when pre-LN (the paper's post-LN has none)."""

    def __init__(self, config: TransformerConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(**config.layer_kwargs()) for _ in range(num_layers))
        self.norm = build_norm(config.norm, config.d_model, config.layer_norm_eps) if config.norm_first else None

    def forward(
        self, x: Tensor, *, key_padding_mask: Tensor | None = None, is_causal: bool = False, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor] | None]:
        """``x (b, s, d)`` through every layer -> the final states and, if ``need_weights``, per-layer weights."""
        attentions: list[Tensor] | None = [] if need_weights else None
        for layer in self.layers:
            out = layer(x, key_padding_mask=key_padding_mask, is_causal=is_causal, need_weights=need_weights)
            x = out.output
            if attentions is not None:
                attentions.append(out.self_weights)
        if self.norm is not None:
            x = self.norm(x)
        return x, attentions


class Decoder(nn.Module):
    """A stack of DecoderLayers (masked self-attention, cross-attention, feed-forward); a final
    LayerNorm when pre-LN."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(**config.layer_kwargs()) for _ in range(config.num_decoder_layers))
        self.norm = build_norm(config.norm, config.d_model, config.layer_norm_eps) if config.norm_first else None

    def forward(
        self,
        x: Tensor,
        memory: EncoderOutput,
        *,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        cache: list[tuple[KVCache, KVCache]] | None = None,
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor] | None, list[tuple[KVCache, KVCache]]]:
        """Target states ``x (b, s_tgt, d)`` through every layer against the encoder ``memory``.
        Returns the hidden states, per-layer self- and cross-attention weights (if asked) and the
        new (self, cross) cache of every layer."""
        self_attns: list[Tensor] | None = [] if need_weights else None
        cross_attns: list[Tensor] | None = [] if need_weights else None
        new_cache: list[tuple[KVCache, KVCache]] = []
        for i, layer in enumerate(self.layers):
            self_cache, cross_cache = (None, None) if cache is None else cache[i]
            out = layer(
                x,
                memory.hidden,
                key_padding_mask=key_padding_mask,
                memory_key_padding_mask=memory.key_padding_mask,
                is_causal=True,
                need_weights=need_weights,
                self_cache=self_cache,
                cross_cache=cross_cache,
            )
            x = out.output
            new_cache.append((out.self_cache, out.cross_cache))
            if self_attns is not None and cross_attns is not None:
                self_attns.append(out.self_weights)
                cross_attns.append(out.cross_weights)
        if self.norm is not None:
            x = self.norm(x)
        return x, self_attns, cross_attns, new_cache


def _init_weights(module: nn.Module, d_model: int, pad_id: int | None) -> None:
    """Xavier-uniform matrices; embeddings N(0, d_model^-0.5) since they are scaled by sqrt(d_model)."""
    for name, param in module.named_parameters():
        if "embedding" in name and param.dim() == 2:
            nn.init.normal_(param, std=d_model**-0.5)
            if pad_id is not None and pad_id < param.size(0):
                with torch.no_grad():
                    param[pad_id].zero_()
        elif param.dim() > 1:
            nn.init.xavier_uniform_(param)


class Transformer(nn.Module):
    """The encoder-decoder Transformer of "Attention Is All You Need".

    ``forward(src, tgt)`` gives next-token logits for every target position (teacher forcing);
    ``encode`` and ``decode`` are the two halves that decoding calls separately.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        check_fits_weights(config.matrix_parameters())
        self.config = config
        d = config.d_model
        src_embedding = nn.Embedding(config.src_vocab_size, d)
        tgt_embedding = src_embedding if config.share_embeddings else nn.Embedding(config.tgt_vocab_size, d)
        positional = build_positional_encoding(config.positional, d, config.max_len)
        if config.positional == "learned":  # a separate learned table for each side
            tgt_positional = build_positional_encoding("learned", d, config.max_len)
        else:
            tgt_positional = positional
        self.src_embed = TokenEmbedding(src_embedding, positional, d, config.dropout)
        self.tgt_embed = TokenEmbedding(tgt_embedding, tgt_positional, d, config.dropout)
        self.encoder = Encoder(config, config.num_encoder_layers)
        self.decoder = Decoder(config)
        self.output_proj = nn.Linear(d, config.tgt_vocab_size, bias=False)
        _init_weights(self, d, config.pad_id)
        if config.tie_output:
            self.output_proj.weight = tgt_embedding.weight

    def encode(
        self, src: Tensor, *, src_key_padding_mask: Tensor | None = None, need_weights: bool = False
    ) -> EncoderOutput:
        """Args: ``src (b, s_src)`` token ids; the padding mask defaults to ``src != pad_id``."""
        if src_key_padding_mask is None:
            src_key_padding_mask = src != self.config.pad_id
        hidden, attentions = self.encoder(
            self.src_embed(src), key_padding_mask=src_key_padding_mask, need_weights=need_weights
        )
        return EncoderOutput(hidden, attentions, src_key_padding_mask)

    def decode(
        self,
        tgt: Tensor,
        memory: EncoderOutput,
        *,
        tgt_key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        cache: list[tuple[KVCache, KVCache]] | None = None,
        project: bool = True,
    ) -> DecoderOutput:
        """Decode target ids against the encoder output.

        Args:
            tgt: ``(b, s_tgt)`` target ids (shifted right: starting with BOS). With a ``cache``, only
                the new step's ids, ``(b, 1)`` usually.
            memory: what :meth:`encode` returned.
            tgt_key_padding_mask: ``(b, s_k)`` True = real; ``s_k`` counts cached steps too. Not
                needed for right-padded targets: the causal mask already hides later pads.
            need_weights: return per-layer self- and cross-attention weights.
            cache: the ``cache`` of the previous step's output; None on the first step.
            project: apply the output projection; False leaves ``logits`` None (see :meth:`loss`).
        """
        start = 0 if cache is None else len(cache[0][0])
        x, self_attns, cross_attns, new_cache = self.decoder(
            self.tgt_embed(tgt, start),
            memory,
            key_padding_mask=tgt_key_padding_mask,
            need_weights=need_weights,
            cache=cache,
        )
        return DecoderOutput(self.output_proj(x) if project else None, x, self_attns, cross_attns, new_cache)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Teacher-forced logits ``(b, s_tgt, V)`` for source ids ``(b, s_src)`` and target ids
        ``(b, s_tgt)`` (shifted right)."""
        memory = self.encode(src, src_key_padding_mask=src_key_padding_mask)
        logits = self.decode(tgt, memory, tgt_key_padding_mask=tgt_key_padding_mask).logits
        assert logits is not None  # decode projects by default
        return logits

    def hidden_states(self, src: Tensor, tgt_in: Tensor, *, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """The decoder's final hidden states ``(b, s_tgt, d)`` for teacher forcing (arguments as
        :meth:`loss`'s): what ``output_proj`` turns into logits, and what a training objective reads
        (:mod:`qkv.training.objectives`), so that it never holds the ``(b, s_tgt, V)`` logits."""
        memory = self.encode(src, src_key_padding_mask=src_key_padding_mask)
        return self.decode(tgt_in, memory, project=False).hidden

    def loss(
        self,
        src: Tensor,
        tgt_in: Tensor,
        tgt_out: Tensor,
        *,
        label_smoothing: float = 0.0,
        src_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Summed label-smoothed cross-entropy of the teacher-forced predictions over the real
        target positions (``tgt_out != pad_id``).

        Equal to ``label_smoothed_cross_entropy(self(src, tgt_in), tgt_out, ...)`` but computed by
        :func:`qkv.nn.loss.fused_linear_cross_entropy`, which never builds the ``(b, s_tgt, V)`` logits.
        Other training objectives are the training layer's (:mod:`qkv.training.objectives`).

        Args:
            src: ``(b, s_src)`` source ids.
            tgt_in: ``(b, s_tgt)`` target ids shifted right (BOS first).
            tgt_out: ``(b, s_tgt)`` the ids to predict (pad where nothing is).
            label_smoothing: ``eps`` of the smoothed target distribution.
            src_key_padding_mask: defaults to ``src != pad_id``.

        Returns:
            The summed loss, a scalar.
        """
        hidden = self.hidden_states(src, tgt_in, src_key_padding_mask=src_key_padding_mask)  # (b, s_tgt, d)
        return fused_linear_cross_entropy(hidden, self.output_proj.weight, tgt_out, label_smoothing, self.config.pad_id)
