"""What the heads do and how attention flows: head statistics, head labels and attention rollout.

Everything here reads attention weights only (one tensor per layer, ``(h, s_q, s_k)``, rows
summing to 1, as :class:`~qkv.viz.export.AttentionView` holds them) and returns plain tensors;
:func:`view_fields` turns them into the optional view fields of the explorer's document
(see :mod:`qkv.viz.export`).

Head statistics (each averaged over the query rows, so ``s`` rows weigh ``1/s`` each):

* ``entropy``: ``-sum_j a_ij ln a_ij`` of each row, in nats.
* ``previous`` / ``same`` / ``next``: the weight on key ``i-1`` / ``i`` / ``i+1`` (a row without
  such a key contributes 0). Self-attention views only.
* ``delimiter``: the weight on the delimiter keys (``[CLS]``/``[SEP]``, ``<s>``/``</s>``, ...).
* ``distance``: ``sum_j a_ij |i - j|``; for cross-attention the distance from the diagonal scaled
  to the two lengths, ``|j - i (s_k - 1) / (s_q - 1)|``.

Head labels (:func:`head_labels`): a head is a *previous-token*, *same-token*, *next-token* or
*delimiter head* when that fraction of its attention is the largest of the four and above
:data:`DOMINANT_FRACTION` (more than half of it, on average); otherwise a *broad head* when its
rows' entropy is above :data:`BROAD_ENTROPY` of the largest entropy they could have (uniform over
the keys a row may see: all of them, or for a causal view the keys up to the row); otherwise no
label.

Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", section 3):
each layer's attention averaged over heads, plus the identity for the residual connection, rows
renormalised (``0.5 A + 0.5 I``), multiplied from the first layer up:
``R_l = Â_l Â_(l-1) ... Â_0``. Row ``i`` of ``R_l`` says how much of the output of layer ``l`` at
position ``i`` comes from each input token. For a translation's cross-attention,
:func:`cross_rollout` maps layer ``l``'s cross-attention (mean over heads, rows renormalised)
through the encoder's full rollout onto the source tokens.

Shape legend: ``L`` layers, ``h`` heads, ``s_q`` queries, ``s_k`` keys, ``s`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from qkv.viz.long_inputs import weights_field


class AttentionViewLike(Protocol):
    """What :func:`view_fields` reads of a :class:`~qkv.viz.export.AttentionView` (declared here, since
    :mod:`qkv.viz.export` imports this module)."""

    keys: list[str]
    attentions: list[Tensor]
    cross: bool


DOMINANT_FRACTION = 0.5  # a pattern dominates when it takes more than half the attention
BROAD_ENTROPY = 0.8  # a broad head's entropy is above 80% of the uniform distribution's
DELIMITER_TOKENS = frozenset({"[CLS]", "[SEP]", "<s>", "</s>", "<|endoftext|>", "<bos>", "<eos>", "<|bos|>", "<|eos|>"})
SELF_STATS = ("entropy", "previous", "same", "next", "delimiter", "distance")
CROSS_STATS = ("entropy", "delimiter", "distance")
LABELS = {
    "previous": "previous-token head",
    "same": "same-token head",
    "next": "next-token head",
    "delimiter": "delimiter head",
}
BROAD_LABEL = "broad head"
DECIMALS = 4


def stack_layers(attentions: Sequence[Tensor] | Tensor) -> Tensor:
    """One ``(L, h, s_q, s_k)`` float64 tensor from per-layer ``(h, s_q, s_k)`` weights."""
    if isinstance(attentions, Tensor):
        stacked = attentions
    else:
        if not attentions:
            raise ValueError("no attention layers")
        stacked = torch.stack([a[0] if a.dim() == 4 else a for a in attentions])
    if stacked.dim() != 4:
        raise ValueError(f"attention must be (layers, heads, s_q, s_k), got shape {tuple(stacked.shape)}")
    return stacked.detach().to(device="cpu", dtype=torch.float64)


def delimiter_indices(tokens: Iterable[str]) -> list[int]:
    """Positions of the tokens counted as delimiters (:data:`DELIMITER_TOKENS`)."""
    return [i for i, token in enumerate(tokens) if token in DELIMITER_TOKENS]


ROW_CHUNK = 256  # query rows processed at a time: (h, 256, 4,096) float32 is 16 MB a head


def _layers(attentions: Sequence[Tensor] | Tensor) -> list[Tensor]:
    """Per-layer ``(h, s_q, s_k)`` CPU tensors, float32 or float64 as given (half precision as float32),
    not copied when already so: a 4,096-token view is GBs, so nothing stacks or upcasts it all."""
    if isinstance(attentions, Tensor):
        if attentions.dim() != 4:
            raise ValueError(f"attention must be (layers, heads, s_q, s_k), got shape {tuple(attentions.shape)}")
        layers = list(attentions.unbind(0))
    else:
        if not attentions:
            raise ValueError("no attention layers")
        layers = [a[0] if a.dim() == 4 else a for a in attentions]
        if any(a.dim() != 3 or a.shape != layers[0].shape for a in layers):
            raise ValueError("attention must be (layers, heads, s_q, s_k): layers of one (h, s_q, s_k) shape")
    dtype = torch.float64 if layers[0].dtype == torch.float64 else torch.float32
    return [a.detach().to(device="cpu", dtype=dtype) for a in layers]


def _chunks(s_q: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the query rows taken :data:`ROW_CHUNK` at a time."""
    return [(r, min(r + ROW_CHUNK, s_q)) for r in range(0, s_q, ROW_CHUNK)]


def _causal(layers: list[Tensor]) -> bool:
    """:func:`is_causal` of per-layer weights, row chunk by row chunk."""
    s_q, s_k = layers[0].shape[-2:]
    if s_q != s_k or s_q < 2:
        return False
    return all(bool(a[:, r0:r1].triu(diagonal=1 + r0).eq(0).all()) for a in layers for r0, r1 in _chunks(s_q))


def is_causal(attention: Tensor) -> bool:
    """Whether a square ``(..., s, s)`` attention puts exactly zero weight above the diagonal
    everywhere (a causal mask's softmax gives exact zeros)."""
    s_q, s_k = attention.shape[-2:]
    if s_q != s_k or s_q < 2:
        return False
    return bool(attention.triu(diagonal=1).eq(0).all())


def _row_entropy(att: Tensor) -> Tensor:
    """``-sum_j a ln a`` per row, with ``0 ln 0 = 0``. ``(..., s_q, s_k) -> (..., s_q)``."""
    return -torch.special.xlogy(att, att).sum(-1)


def _row_stats(layers: list[Tensor], delimiters: Sequence[int], cross: bool) -> dict[str, Tensor]:
    """Per-row statistics ``(L, h, s_q)`` float64 (entropy, delimiter and distance; for self-attention
    also previous/same/next), computed row chunk by row chunk in the weights' own precision."""
    s_q, s_k = layers[0].shape[-2:]
    dtype = layers[0].dtype
    cols = torch.arange(s_k, dtype=dtype)
    index = torch.tensor(list(delimiters), dtype=torch.long)
    names = ("entropy", "delimiter", "distance") + (() if cross else ("previous", "same", "next"))
    out = {name: torch.zeros(len(layers), layers[0].shape[0], s_q, dtype=torch.float64) for name in names}
    for r0, r1 in _chunks(s_q):
        rows = torch.arange(r0, r1, dtype=torch.float64)
        centre = rows * (s_k - 1) / max(s_q - 1, 1) if cross else rows  # where row i sits on the diagonal
        offsets = (cols[None, :] - centre.to(dtype)[:, None]).abs()  # (rows, s_k)
        for layer, att in enumerate(layers):
            chunk = att[:, r0:r1]  # (h, rows, s_k)
            out["entropy"][layer, :, r0:r1] = _row_entropy(chunk)
            out["delimiter"][layer, :, r0:r1] = chunk.index_select(-1, index).sum(-1)
            out["distance"][layer, :, r0:r1] = (chunk * offsets).sum(-1)
            if not cross:
                for name, shift in (("previous", -1), ("same", 0), ("next", 1)):
                    keys = torch.arange(r0, r1) + shift
                    ok = (keys >= 0) & (keys < s_k)
                    picked = chunk.gather(-1, keys.clamp(0, s_k - 1).expand(chunk.shape[0], -1)[..., None])[..., 0]
                    out[name][layer, :, r0:r1] = picked * ok
    return out


def _check(layers: list[Tensor], delimiters: Sequence[int], cross: bool) -> None:
    """ValueError for a non-square self-attention view or a delimiter outside the keys."""
    s_q, s_k = layers[0].shape[-2:]
    if not cross and s_q != s_k:
        raise ValueError(f"a self-attention view must be square, got s_q={s_q}, s_k={s_k}")
    bad = [d for d in delimiters if not 0 <= d < s_k]
    if bad:
        raise ValueError(f"delimiter positions {bad} are outside the {s_k} keys")


def head_stats(
    attentions: Sequence[Tensor] | Tensor, *, delimiters: Sequence[int] = (), cross: bool = False
) -> dict[str, Tensor]:
    """The head statistics of one view (see the module docstring for their definitions).

    Args:
        attentions: per layer ``(h, s_q, s_k)`` (or one ``(L, h, s_q, s_k)`` tensor).
        delimiters: key positions counted as delimiters.
        cross: a cross-attention view (queries and keys are different sequences): only
            ``entropy``, ``delimiter`` and ``distance``, the distance taken from the scaled diagonal.

    Returns:
        statistic name -> ``(L, h)`` float64 tensor; the names are :data:`SELF_STATS` or
        :data:`CROSS_STATS`, in that order.

    Raises:
        ValueError: a self-attention view that is not square, or a delimiter out of range.
    """
    layers = _layers(attentions)
    _check(layers, delimiters, cross)
    per_row = _row_stats(layers, delimiters, cross)
    return {name: per_row[name].mean(-1) for name in (CROSS_STATS if cross else SELF_STATS)}


def _entropy_ratio(entropy: Tensor, causal: bool, s_k: int) -> Tensor:
    """:func:`entropy_ratio` from per-row entropies ``(L, h, s_q)``."""
    s_q = entropy.shape[-1]
    visible = torch.arange(1, s_q + 1, dtype=torch.float64) if causal else torch.full((s_q,), float(s_k))
    usable = visible > 1
    if not usable.any():
        return torch.zeros(entropy.shape[:2], dtype=torch.float64)
    return (entropy[..., usable] / visible[usable].log()).mean(-1)  # (L, h) over the rows that can spread


def entropy_ratio(attentions: Sequence[Tensor] | Tensor) -> Tensor:
    """Each head's row entropy as a fraction of the largest it could be, averaged over the rows
    that can see more than one key (for a causal view, row ``i`` sees ``i + 1`` keys).

    Returns:
        ``(L, h)`` float64 tensor in [0, 1] (0 when no row sees more than one key).
    """
    layers = _layers(attentions)
    entropy = torch.stack(
        [torch.cat([_row_entropy(a[:, r0:r1]) for r0, r1 in _chunks(a.shape[1])], -1) for a in layers]
    )
    return _entropy_ratio(entropy.double(), _causal(layers), layers[0].shape[-1])


def head_labels(stats: dict[str, Tensor], broadness: Tensor) -> list[list[str | None]]:
    """The pattern each head matches best, when one dominates (thresholds in the module docstring).

    Args:
        stats: from :func:`head_stats` (or averaged over sentences).
        broadness: ``(L, h)`` from :func:`entropy_ratio` (or averaged likewise).

    Returns:
        ``[L][h]`` of a label from :data:`LABELS` or :data:`BROAD_LABEL`, or None.
    """
    fractions = [name for name in LABELS if name in stats]
    layers, heads = broadness.shape
    out: list[list[str | None]] = []
    for layer in range(layers):
        row: list[str | None] = []
        for head in range(heads):
            values = {name: float(stats[name][layer, head]) for name in fractions}
            best = max(values, key=lambda name: values[name]) if values else None
            if best is not None and values[best] > DOMINANT_FRACTION:
                row.append(LABELS[best])
            elif float(broadness[layer, head]) > BROAD_ENTROPY:
                row.append(BROAD_LABEL)
            else:
                row.append(None)
        out.append(row)
    return out


def _head_mean(att: Tensor) -> Tensor:
    """One layer's ``(h, s_q, s_k)`` averaged over heads, row chunk by row chunk (no ``h``-fold temporary)."""
    out = torch.empty(att.shape[1:], dtype=att.dtype)
    for r0, r1 in _chunks(att.shape[1]):
        out[r0:r1] = att[:, r0:r1].mean(0)
    return out


def rollout(attentions: Sequence[Tensor] | Tensor) -> Tensor:
    """Attention rollout through layers ``0..l`` for every ``l`` (Abnar & Zuidema 2020).

    Args:
        attentions: a self-attention view's weights, per layer ``(h, s, s)``.

    Returns:
        ``(L, s, s)`` in the weights' precision (float64 weights give float64, others float32):
        entry ``[l, i, j]`` is how much of position ``i`` after layer ``l`` comes from input token
        ``j``; every row sums to 1.
    """
    layers = _layers(attentions)
    s_q, s_k = layers[0].shape[-2:]
    if s_q != s_k:
        raise ValueError(f"rollout needs square self-attention, got s_q={s_q}, s_k={s_k}")
    out = torch.empty(len(layers), s_q, s_q, dtype=layers[0].dtype)
    for index, att in enumerate(layers):
        mixed = _head_mean(att)  # (s, s): attention plus the residual connection, rows renormalised
        mixed.diagonal().add_(1.0)
        mixed /= mixed.sum(-1, keepdim=True)
        if index == 0:
            out[0] = mixed  # the first layer's flow is its own mixed attention
        else:
            torch.matmul(mixed, out[index - 1], out=out[index])
    return out


def cross_rollout(cross_attentions: Sequence[Tensor] | Tensor, encoder_rollout: Tensor) -> Tensor:
    """Cross-attention mapped onto the source tokens through the encoder's rollout.

    Args:
        cross_attentions: per decoder layer ``(h, s_t, s_src)``.
        encoder_rollout: ``(s_src, s_src)``, the encoder's rollout through all its layers (the
            last entry of :func:`rollout` of the encoder self-attention).

    Returns:
        ``(L, s_t, s_src)`` (float64 when both inputs are, else float32): layer ``l``'s
        cross-attention (mean over heads, rows renormalised) times ``encoder_rollout``.
    """
    layers = _layers(cross_attentions)
    s_src = layers[0].shape[-1]
    if tuple(encoder_rollout.shape) != (s_src, s_src):
        raise ValueError(f"the encoder rollout is {tuple(encoder_rollout.shape)}; the cross-attention has {s_src} keys")
    dtype = torch.float64 if layers[0].dtype == encoder_rollout.dtype == torch.float64 else torch.float32
    encoder = encoder_rollout.detach().to(device="cpu", dtype=dtype)
    out = []
    for att in layers:
        mean = _head_mean(att).to(dtype)  # (s_t, s_src)
        mean /= mean.sum(-1, keepdim=True).clamp(min=1e-12)
        out.append(mean @ encoder)
    return torch.stack(out)


def rounded(values: Tensor | float, decimals: int = DECIMALS) -> float | list[Any]:
    """Nested lists (or a float) rounded to ``decimals`` places, to keep the document small."""
    if isinstance(values, Tensor):
        return values.double().round(decimals=decimals).tolist()
    return round(float(values), decimals)


def view_fields(
    view: AttentionViewLike, *, encoder_rollout: Tensor | None = None, delimiters: Sequence[int] | None = None
) -> dict[str, object]:
    """The optional analysis fields of one view of the document: ``stats``, ``delimiters``,
    ``labels`` and ``rollout`` (see :mod:`qkv.viz.export`).

    Args:
        view: an :class:`~qkv.viz.export.AttentionView` (``view.cross`` for cross-attention:
            rows are target tokens, columns source tokens).
        encoder_rollout: for a cross-attention view, the encoder's full rollout ``(s_src, s_src)``;
            without it a cross-attention view gets no ``rollout``.
        delimiters: key positions counted as delimiters (default: :func:`delimiter_indices` of the keys).

    Returns:
        A dict to merge into the view's dict; every number rounded to 4 decimals.
    """
    layers, cross = _layers(view.attentions), view.cross
    delimiters = delimiter_indices(view.keys) if delimiters is None else list(delimiters)
    _check(layers, delimiters, cross)
    per_row = _row_stats(layers, delimiters, cross)  # once, for the statistics and the broadness
    stats = {name: per_row[name].mean(-1) for name in (CROSS_STATS if cross else SELF_STATS)}
    broadness = _entropy_ratio(per_row["entropy"], _causal(layers), layers[0].shape[-1])
    fields: dict[str, object] = {
        "stats": {name: rounded(value) for name, value in stats.items()},
        "delimiters": delimiters,
        "labels": head_labels(stats, broadness),
    }
    # a long input's rollout (more than FULL_WEIGHTS_LIMIT weights) in its reduced form (qkv.viz.long_inputs)
    if not cross:
        fields["rollout"] = weights_field(rollout(layers))
    elif encoder_rollout is not None:
        fields["rollout"] = weights_field(cross_rollout(layers, encoder_rollout))
    return fields
