"""The explorer's document from attention tensors given directly, in bertviz's calling style.

``transformers`` returns, with ``output_attentions=True``, one tensor per layer of shape
``(batch, heads, s_q, s_k)``; bertviz's ``head_view(attention, tokens)`` takes that tuple for one
input (batch 1) and its tokens. :func:`tensor_document` turns the same arguments (self-attention,
or an encoder-decoder's ``encoder_attention`` / ``decoder_attention`` / ``cross_attention``) into a
``qkv-attention/1`` document (:mod:`qkv.viz.export`) with each view's head statistics, labels and
rollout (:mod:`qkv.viz.analysis`); every shape is checked first, so a mistake is a one-line
``ValueError`` here, never a broken drawing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.viz.analysis import rollout, view_fields
from qkv.viz.export import AttentionView, explorer_data
from qkv.viz.lm_explorer import byte_level_text, visible


def is_attention_tensors(value: object) -> bool:
    """Whether ``value`` looks like attention weights (a tensor, an array, or a non-empty tuple/list
    of them) rather than a model, a run folder or a text."""
    if isinstance(value, (Tensor, np.ndarray)):
        return True
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(v, (Tensor, np.ndarray)) or v is None for v in value)
    )


def layer_tensors(attention: object, what: str) -> list[Tensor]:
    """One ``(heads, s_q, s_k)`` float tensor per layer from ``attention``: a tuple/list of per-layer
    ``(1, heads, s_q, s_k)`` or ``(heads, s_q, s_k)`` tensors or arrays, or one stacked
    ``(layers, 1, heads, s_q, s_k)`` / ``(layers, heads, s_q, s_k)`` tensor.

    Raises:
        ValueError: nothing given, a layer missing (``None``), a batch of more than one input, a
            shape that is not 3- or 4-D, or a value that is NaN or infinite.
    """
    if isinstance(attention, (Tensor, np.ndarray)):
        stacked = torch.as_tensor(attention)
        if stacked.dim() not in (4, 5):
            raise ValueError(
                f"{what}: a single tensor must be stacked layers (layers, 1, heads, s_q, s_k), got shape "
                f"{tuple(stacked.shape)}; or pass a tuple of per-layer (1, heads, s_q, s_k) tensors"
            )
        items: list[object] = list(stacked.unbind(0))
    elif isinstance(attention, (list, tuple)) and attention:
        items = list(attention)
    else:
        raise ValueError(
            f"{what}: expected a tuple of per-layer (1, heads, s_q, s_k) tensors, got {type(attention).__name__}"
        )
    layers = []
    for i, item in enumerate(items):
        if item is None:
            raise ValueError(f"{what}: layer {i} is None (was the model run with output_attentions=True?)")
        if not isinstance(item, (Tensor, np.ndarray)):
            raise ValueError(f"{what}: layer {i} is a {type(item).__name__}, not a tensor or array")
        a = torch.as_tensor(item).detach().to("cpu", torch.float64)
        if a.dim() == 4:
            if a.size(0) != 1:
                raise ValueError(
                    f"{what}: layer {i} holds a batch of {a.size(0)} inputs {tuple(a.shape)}; the explorer shows "
                    f"one: pass [a[j : j + 1] for a in attention]"
                )
            a = a[0]
        if a.dim() != 3:
            raise ValueError(
                f"{what}: layer {i} must be (1, heads, s_q, s_k) or (heads, s_q, s_k), got {tuple(a.shape)}"
            )
        if not bool(torch.isfinite(a).all()):
            raise ValueError(f"{what}: layer {i} holds NaN or infinite weights")
        layers.append(a)
    return layers


def pretty_tokens(tokens: Sequence[object], prettify: bool = True) -> list[str]:
    """Readable token labels: with ``prettify``, a byte-level BPE token (GPT-2's ``Ġ``-prefixed
    words) as the text it stands for and a SentencePiece ``▁`` as a space; then spaces and control
    characters made visible (``␣``, ``⏎``; :func:`qkv.viz.lm_explorer.visible`).

    Raises:
        ValueError: ``tokens`` is a single string instead of a list of them.
    """
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise ValueError(f"tokens must be a list of strings, got {type(tokens).__name__}")
    labels = [str(t) for t in tokens]
    if not prettify:
        return labels
    byte_level = any("\u0120" in t or "\u010a" in t for t in labels)  # Ġ (space), Ċ (newline)
    out = []
    for token in labels:
        text = byte_level_text(token) if byte_level else None
        if text is None:
            text = token.replace("\u2581", " ")  # ▁
        out.append(visible(text))
    return out


def _view(
    name: str,
    attention: object,
    queries: list[str],
    keys: list[str],
    include_layers: Sequence[int] | None,
    *,
    cross: bool = False,
) -> AttentionView:
    """The view of ``attention`` (its ``include_layers`` only, named so), sizes checked against the tokens."""
    layers = layer_tensors(attention, name)
    if include_layers is not None:
        total = len(layers)
        if not include_layers or not all(isinstance(i, int) and 0 <= i < total for i in include_layers):
            raise ValueError(f"include_layers must be layer indices below {total}, got {list(include_layers)}")
        layers = [layers[i] for i in include_layers]
        name += f" (layers {', '.join(map(str, include_layers))} of {total}, shown as 0-{len(layers) - 1})"
    s_q, s_k = layers[0].shape[1:]
    if (s_q, s_k) != (len(queries), len(keys)):
        given = f"{len(queries)} tokens" if queries is keys else f"{len(queries)} query and {len(keys)} key tokens"
        raise ValueError(f"{name}: the attention is {s_q} x {s_k} (s_q x s_k) but {given} were given")
    return AttentionView(name, queries, keys, layers, cross=cross)


def _with_fields(view: AttentionView, encoder_rollout: Tensor | None = None) -> dict[str, Any]:
    return dict(view.to_dict(), **view_fields(view, encoder_rollout=encoder_rollout))


def tensor_document(
    attention: object = None,
    tokens: Sequence[object] | None = None,
    *,
    sentence_b_start: int | None = None,
    prettify_tokens: bool = True,
    encoder_attention: object = None,
    decoder_attention: object = None,
    cross_attention: object = None,
    encoder_tokens: Sequence[object] | None = None,
    decoder_tokens: Sequence[object] | None = None,
    include_layers: Sequence[int] | None = None,
    name: str = "",
) -> dict[str, Any]:
    """A ``qkv-attention/1`` document of one input from its attention tensors.

    Args:
        attention: self-attention, one ``(1, heads, s, s)`` tensor per layer (what ``transformers``
            returns with ``output_attentions=True``), or a stacked tensor; or None with the
            encoder-decoder arguments.
        tokens: the ``s`` tokens (strings), e.g. ``tokenizer.convert_ids_to_tokens(ids[0])``.
        sentence_b_start: the index of the second sentence's first token: adds the views
            "sentence A -> A", "A -> B", "B -> A" and "B -> B" (blocks of the full matrix, not
            renormalised) after "self-attention".
        prettify_tokens: show byte-level BPE and SentencePiece tokens as their text (:func:`pretty_tokens`).
        encoder_attention, decoder_attention, cross_attention: an encoder-decoder's three kinds,
            per layer ``(1, heads, s_src, s_src)``, ``(1, heads, s_tgt, s_tgt)`` and
            ``(1, heads, s_tgt, s_src)``; any of them may be given (cross needs both token lists).
        encoder_tokens, decoder_tokens: the source and target tokens.
        include_layers: show only these layers (their indices in the given tuple).
        name: the model's name shown in the page.

    Returns:
        The document (:func:`qkv.viz.export.explorer_data`), one example.

    Raises:
        ValueError: a shape that disagrees with the token counts, a batch of several inputs, a
            missing argument, or both styles mixed.
    """
    seq2seq = any(a is not None for a in (encoder_attention, decoder_attention, cross_attention))
    if attention is not None and seq2seq:
        raise ValueError("pass either attention (with tokens) or encoder/decoder/cross_attention, not both")
    if attention is not None:
        if tokens is None:
            raise ValueError("attention needs its tokens: head_view(attention, tokens)")
        labels = pretty_tokens(tokens, prettify_tokens)
        views = _self_attention_views(attention, labels, sentence_b_start, include_layers)
        text = " ".join(labels)
    elif seq2seq:
        if sentence_b_start is not None:
            raise ValueError("sentence_b_start is for self-attention (attention, tokens), not encoder-decoder views")
        src = pretty_tokens(encoder_tokens, prettify_tokens) if encoder_tokens is not None else None
        tgt = pretty_tokens(decoder_tokens, prettify_tokens) if decoder_tokens is not None else None
        given = {"encoder": encoder_attention, "decoder": decoder_attention, "cross": cross_attention}
        views = _seq2seq_views(given, src, tgt, include_layers)
        text = " ".join(src or tgt or [])
    else:
        raise ValueError("no attention given: head_view(attention, tokens), or encoder/decoder/cross_attention")
    example = {"text": text, "model": name, "output": None, "views": views}  # make_example's fields
    return explorer_data([example], title=f"qkv attention explorer{': ' + name if name else ''}")


def _self_attention_views(
    attention: object, labels: list[str], sentence_b_start: int | None, include_layers: Sequence[int] | None
) -> list[dict[str, Any]]:
    """The self-attention view, then (with ``sentence_b_start``) its four sentence-to-sentence blocks."""
    full = _view("self-attention", attention, labels, labels, include_layers)
    note = full.name[len("self-attention") :]  # which layers, when include_layers chose some
    views = [_with_fields(full)]
    if sentence_b_start is None:
        return views
    n = len(labels)
    if not isinstance(sentence_b_start, int) or not 0 < sentence_b_start < n:
        raise ValueError(f"sentence_b_start must be a token index between 1 and {n - 1}, got {sentence_b_start}")
    spans = {"A": slice(0, sentence_b_start), "B": slice(sentence_b_start, n)}
    for q in "AB":
        for k in "AB":
            block = [a[:, spans[q], spans[k]] for a in full.attentions]
            part = AttentionView(
                f"sentence {q} \u2192 {k}{note}", labels[spans[q]], labels[spans[k]], block, cross=q != k
            )
            views.append(_with_fields(part))
    return views


def _seq2seq_views(
    given: dict[str, object], src: list[str] | None, tgt: list[str] | None, include_layers: Sequence[int] | None
) -> list[dict[str, Any]]:
    """An encoder-decoder's views (those ``given`` holds: encoder, decoder, cross), in that order."""
    views: list[dict[str, Any]] = []
    encoder_rollout = None
    for kind, attention, queries, keys in (
        ("encoder self-attention", given["encoder"], src, src),
        ("decoder self-attention", given["decoder"], tgt, tgt),
        ("cross-attention", given["cross"], tgt, src),
    ):
        if attention is None:
            continue
        if queries is None or keys is None:
            needed = "encoder_tokens and decoder_tokens" if kind == "cross-attention" else kind.split()[0] + "_tokens"
            raise ValueError(f"{kind} needs {needed}")
        cross = kind == "cross-attention"
        view = _view(kind, attention, queries, keys, include_layers, cross=cross)
        views.append(_with_fields(view, encoder_rollout if cross else None))
        if kind == "encoder self-attention":
            encoder_rollout = rollout(view.attentions)[-1]
    return views
