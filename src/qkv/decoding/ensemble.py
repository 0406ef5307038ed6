"""Decode with several translation models at once: an ensemble averages their next-token probabilities.

:class:`Ensemble` looks like one :class:`~qkv.models.transformer.Transformer` to :mod:`qkv.decoding.search` and
:func:`qkv.decoding.translate.translate_texts`: ``encode`` runs every member's encoder and ``decode`` every
member's decoder, and the returned ``logits`` are ``log(mean_i p_i)``, the log of the members'
averaged probabilities (normalised log-probabilities, so greedy picks and beam scores work on them
unchanged). Members must share the tokenizer: the same vocabulary sizes, padding id and
positional length.

The members' state travels inside the shapes beam search already reorders: the encoder outputs
are concatenated along the feature axis (``(b, s_src, sum of d_model)``), and the per-layer KV
caches are one list, member after member.

Shape legend: ``b`` sentences (times the beam), ``s_src`` source length, ``V`` target vocabulary.
"""

from __future__ import annotations

import json
import math
from typing import TypeVar, cast

import torch
from torch import Tensor, nn

from qkv.attention.multihead import KVCache
from qkv.data.tokenizer import Tokenizer
from qkv.models.transformer import DecoderOutput, EncoderOutput, Transformer

T = TypeVar("T")


class Ensemble(nn.Module):
    """Average the next-token probabilities of ``models`` (two or more :class:`Transformer`)."""

    def __init__(self, models: list[Transformer]) -> None:
        super().__init__()
        if len(models) < 2:
            raise ValueError(f"an ensemble needs at least 2 models, got {len(models)}")
        first = models[0].config
        for i, model in enumerate(models[1:], start=2):
            c = model.config
            for name in ("src_vocab_size", "tgt_vocab_size", "pad_id", "max_len"):
                if getattr(c, name) != getattr(first, name):
                    raise ValueError(
                        f"model {i} has {name} {getattr(c, name)} but model 1 has {getattr(first, name)}: "
                        "ensembled models must share one tokenizer"
                    )
        self.members = nn.ModuleList(models)
        self.config = first  # decoding reads pad_id and max_len from it
        self._widths = [m.config.d_model for m in models]
        self._layers = [m.config.num_decoder_layers for m in models]

    def encode(self, src: Tensor, *, src_key_padding_mask: Tensor | None = None) -> EncoderOutput:
        """Run every member's encoder over the same source.

        Args:
            src: ``(b, s_src)`` source ids.
            src_key_padding_mask: ``(b, s_src)``, True = real token; None: each member derives it from
                ``src != pad_id``.

        Returns:
            The members' encoder outputs concatenated along the feature axis, ``(b, s_src, sum of
            d_model)``, with the first member's padding mask (the members share the tokenizer, so
            their masks are the same).
        """
        outputs = [m.encode(src, src_key_padding_mask=src_key_padding_mask) for m in self._models()]
        hidden = torch.cat([o.hidden for o in outputs], dim=-1)  # (b, s_src, sum of d_model)
        return EncoderOutput(hidden, None, outputs[0].key_padding_mask)

    def _models(self) -> list[Transformer]:
        """The members, as the Transformers they are (a ModuleList holds them, for their parameters)."""
        return cast(list[Transformer], list(self.members))

    def decode(
        self, tgt: Tensor, memory: EncoderOutput, *, cache: list[tuple[KVCache, KVCache]] | None = None
    ) -> DecoderOutput:
        """Run every member's decoder and average their next-token probabilities.

        Args:
            tgt: ``(b, s_tgt)`` target ids (with a ``cache``, only the new step's).
            memory: what :meth:`encode` returned: the members' encoder outputs side by side.
            cache: the members' per-layer (self, cross) caches, member after member, as the previous
                call returned them; None on the first step.

        Returns:
            ``logits`` ``(b, s_tgt, V)``, the log of the members' mean probabilities (already
            normalised); ``hidden``, the last member's final states (the members' widths may
            differ); and the new cache, member after member.
        """
        hiddens = memory.hidden.split(self._widths, dim=-1)
        caches: list[list[tuple[KVCache, KVCache]] | None]
        caches = list(_split(cache, self._layers)) if cache is not None else [None] * len(self.members)
        log_probs: list[Tensor] = []
        new_cache: list[tuple[KVCache, KVCache]] = []
        for model, hidden, member_cache in zip(self._models(), hiddens, caches):
            out = model.decode(tgt, EncoderOutput(hidden, None, memory.key_padding_mask), cache=member_cache)
            assert out.logits is not None and out.cache is not None  # decode projects and caches unless told not to
            log_probs.append(torch.log_softmax(out.logits.float(), dim=-1))
            new_cache.extend(out.cache)
        mean = torch.logsumexp(torch.stack(log_probs), dim=0) - math.log(len(log_probs))  # (b, s_tgt, V)
        return DecoderOutput(mean, out.hidden, cache=new_cache)  # hidden: the last member's (widths may differ)


def _split(items: list[T], counts: list[int]) -> list[list[T]]:
    parts: list[list[T]] = []
    start = 0
    for n in counts:
        parts.append(items[start : start + n])
        start += n
    return parts


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two runs' tokenizers are one and the same (vocabulary, merges and settings)."""
    return json.loads(a.backend.to_str()) == json.loads(b.backend.to_str())
