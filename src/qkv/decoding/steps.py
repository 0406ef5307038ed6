"""The decoder's steps as greedy decoding and beam search drive them: ids so far in, next-token logits out.

:func:`decoder_steps` gives one of two implementations of the same steps:

* :class:`~qkv.decoding.inference.InferenceSteps`, when given an
  :class:`~qkv.decoding.inference.InferenceModel`: the model's own layers over packed and fused
  products, the memory kept once for a sentence's beams;
* :class:`PlainSteps` otherwise: :meth:`Transformer.decode` (or an :class:`Ensemble`'s) with its KV
  cache, or without one (``use_cache=False``: the whole prefix again every step, the slow reference).

tests/test_decoding_speedpath.py and tests/test_inference_model.py hold the two to the same logits.
:func:`encode` is the encoder's pass the same way.

Shape legend: ``b`` rows (sentences, times the beam), ``t`` decoded length, ``V`` target vocabulary.
"""

from __future__ import annotations

import warnings
from typing import Protocol

from torch import Tensor

from qkv.attention.multihead import KVCache
from qkv.decoding.ensemble import Ensemble
from qkv.decoding.inference import InferenceModel, InferenceSteps, applies
from qkv.models.transformer import EncoderOutput, Transformer

Decodable = Transformer | Ensemble | InferenceModel  # what the decoding functions take


class Steps(Protocol):
    """A decoding call's steps: ``steps(tokens)`` with the ids so far, ``(b, t)`` BOS first, gives
    the logits of the next token, ``(b, V)``; ``steps.select(index, memory_index)`` keeps the rows
    ``index`` (in that order, repeats allowed) and the memory's rows ``memory_index`` (None: as
    they are; the memory does not depend on the decoded prefix, so beam search reorders it only when
    a sentence leaves)."""

    def __call__(self, tokens: Tensor) -> Tensor: ...

    def select(self, index: Tensor, memory_index: Tensor | None) -> None:
        """Keep the rows ``index`` of the decoded state and the memory's rows ``memory_index``.

        Args:
            index: ``(b',)`` the rows to keep, in that order, repeats allowed.
            memory_index: ``(b',)`` the memory's rows to keep; None: the memory as it is.
        """
        ...


class PlainSteps:
    """Steps through ``model.decode``, keeping its KV cache (none when ``use_cache`` is False)."""

    def __init__(self, model: Transformer | Ensemble, memory: EncoderOutput, use_cache: bool = True) -> None:
        self.model, self.memory, self.use_cache = model, memory, use_cache
        self.cache: list[tuple[KVCache, KVCache]] | None = None

    def __call__(self, tokens: Tensor) -> Tensor:
        """``tokens (b, t)``, BOS first -> the logits of the token after them, ``(b, V)``."""
        out = self.model.decode(tokens if self.cache is None else tokens[:, -1:], self.memory, cache=self.cache)
        if self.use_cache:
            self.cache = out.cache
        assert out.logits is not None  # decode projects unless told not to
        return out.logits[:, -1]

    def select(self, index: Tensor, memory_index: Tensor | None) -> None:
        """Reorder the KV cache and, when ``memory_index`` is given, the memory (see :class:`Steps`).

        Args:
            index: ``(b',)`` the rows of the self-attention cache to keep, in that order.
            memory_index: ``(b',)`` the rows of the memory, its padding mask and the cross-attention
                cache to keep; None: those stay as they are.
        """
        if memory_index is not None:
            hidden, mask = self.memory.hidden.index_select(0, memory_index), self.memory.key_padding_mask
            self.memory = EncoderOutput(hidden, None, None if mask is None else mask.index_select(0, memory_index))
        if self.cache is not None:
            self.cache = [
                (own.index_select(index), cross if memory_index is None else cross.index_select(memory_index))
                for own, cross in self.cache
            ]


def for_decoding(model: Decodable, use_cache: bool = True) -> Decodable:
    """What a decoding call decodes with: ``model`` itself when it is an :class:`InferenceModel`; an
    :class:`InferenceModel` built for the call from a plain :class:`Transformer` where
    :func:`~qkv.decoding.inference.applies` (with ``use_cache``); else ``model`` (its own ``encode``
    and ``decode``)."""
    if use_cache and not isinstance(model, InferenceModel) and applies(model):
        return InferenceModel.build(model)  # type: ignore[arg-type]
    return model


def decoder_steps(model: Decodable, memory: EncoderOutput, use_cache: bool = True) -> Steps:
    """``model``'s decoding steps over ``memory`` (see the module's docstring); a plain model is
    decoded by its own ``decode`` (call :func:`for_decoding` first for the fast path)."""
    if isinstance(model, InferenceModel):
        return model.steps(memory) if use_cache else PlainSteps(model.model, memory, use_cache)
    return PlainSteps(model, memory, use_cache)


def encode(model: Decodable, src: Tensor) -> EncoderOutput:
    """``model.encode(src)`` for decoding: ``src (b, s_src)`` padded ids -> the memory (no attention
    weights)."""
    return model.encode(src)


def fast_steps_apply(model: Transformer, memory: EncoderOutput) -> bool:
    """Deprecated: whether decoding ``model`` builds an :class:`InferenceModel`
    (:func:`qkv.decoding.inference.applies`)."""
    warnings.warn("fast_steps_apply is qkv.decoding.inference.applies", DeprecationWarning, stacklevel=2)
    return applies(model) and memory.key_padding_mask is not None


def fast_encoder_applies(model: Transformer) -> bool:
    """Deprecated: :func:`qkv.decoding.inference.applies`."""
    warnings.warn("fast_encoder_applies is qkv.decoding.inference.applies", DeprecationWarning, stacklevel=2)
    return applies(model)


class FastSteps(InferenceSteps):
    """Deprecated: ``InferenceModel.build(model).steps(memory)``."""

    def __init__(self, model: Transformer, memory: EncoderOutput) -> None:
        warnings.warn(
            "FastSteps(model, memory) is InferenceModel.build(model).steps(memory) (qkv.decoding.inference)",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(InferenceModel.build(model), memory)
