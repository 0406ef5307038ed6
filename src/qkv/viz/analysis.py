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


def is_causal(attention: Tensor) -> bool:
    """Whether a square ``(..., s, s)`` attention puts exactly zero weight above the diagonal
    everywhere (a causal mask's softmax gives exact zeros)."""
    s_q, s_k = attention.shape[-2:]
    if s_q != s_k or s_q < 2:
        return False
    return bool(attention.triu(diagonal=1).eq(0).all())


def _row_entropy(att: Tensor) -> Tensor:
    """``-sum_j a ln a`` per row, with ``0 ln 0 = 0``. ``(..., s_q, s_k) -> (..., s_q)``."""
    logs = torch.where(att > 0, att, torch.ones_like(att)).log()
    return -(att * logs).sum(-1)


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
    att = stack_layers(attentions)  # (L, h, s_q, s_k)
    s_q, s_k = att.shape[-2:]
    if not cross and s_q != s_k:
        raise ValueError(f"a self-attention view must be square, got s_q={s_q}, s_k={s_k}")
    bad = [d for d in delimiters if not 0 <= d < s_k]
    if bad:
        raise ValueError(f"delimiter positions {bad} are outside the {s_k} keys")
    rows = torch.arange(s_q, dtype=torch.float64)
    cols = torch.arange(s_k, dtype=torch.float64)
    if cross:
        diagonal = rows * (s_k - 1) / max(s_q - 1, 1)  # (s_q,) where row i would sit on a straight alignment
        offsets = (cols[None, :] - diagonal[:, None]).abs()  # (s_q, s_k)
    else:
        offsets = (cols[None, :] - rows[:, None]).abs()
    stats = {"entropy": _row_entropy(att).mean(-1)}
    if not cross:
        stats["previous"] = att.diagonal(offset=-1, dim1=-2, dim2=-1).sum(-1) / s_q
        stats["same"] = att.diagonal(dim1=-2, dim2=-1).sum(-1) / s_q
        stats["next"] = att.diagonal(offset=1, dim1=-2, dim2=-1).sum(-1) / s_q
    index = torch.tensor(list(delimiters), dtype=torch.long)
    stats["delimiter"] = att.index_select(-1, index).sum((-2, -1)) / s_q
    stats["distance"] = (att * offsets).sum(-1).mean(-1)
    return stats


def entropy_ratio(attentions: Sequence[Tensor] | Tensor) -> Tensor:
    """Each head's row entropy as a fraction of the largest it could be, averaged over the rows
    that can see more than one key (for a causal view, row ``i`` sees ``i + 1`` keys).

    Returns:
        ``(L, h)`` float64 tensor in [0, 1] (0 when no row sees more than one key).
    """
    att = stack_layers(attentions)
    s_q, s_k = att.shape[-2:]
    visible = torch.arange(1, s_q + 1, dtype=torch.float64) if is_causal(att) else torch.full((s_q,), float(s_k))
    usable = visible > 1
    if not usable.any():
        return torch.zeros(att.shape[:2], dtype=torch.float64)
    ratio = _row_entropy(att)[..., usable] / visible[usable].log()  # (L, h, rows that can spread)
    return ratio.mean(-1)


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


def rollout(attentions: Sequence[Tensor] | Tensor) -> Tensor:
    """Attention rollout through layers ``0..l`` for every ``l`` (Abnar & Zuidema 2020).

    Args:
        attentions: a self-attention view's weights, per layer ``(h, s, s)``.

    Returns:
        ``(L, s, s)`` float64: entry ``[l, i, j]`` is how much of position ``i`` after layer ``l``
        comes from input token ``j``; every row sums to 1.
    """
    att = stack_layers(attentions)  # (L, h, s, s)
    s_q, s_k = att.shape[-2:]
    if s_q != s_k:
        raise ValueError(f"rollout needs square self-attention, got s_q={s_q}, s_k={s_k}")
    eye = torch.eye(s_q, dtype=torch.float64)
    out, flow = [], eye
    for layer in att:
        mixed = layer.mean(0) + eye  # (s, s): attention plus the residual connection
        mixed = mixed / mixed.sum(-1, keepdim=True)
        flow = mixed @ flow
        out.append(flow)
    return torch.stack(out)


def cross_rollout(cross_attentions: Sequence[Tensor] | Tensor, encoder_rollout: Tensor) -> Tensor:
    """Cross-attention mapped onto the source tokens through the encoder's rollout.

    Args:
        cross_attentions: per decoder layer ``(h, s_t, s_src)``.
        encoder_rollout: ``(s_src, s_src)``, the encoder's rollout through all its layers (the
            last entry of :func:`rollout` of the encoder self-attention).

    Returns:
        ``(L, s_t, s_src)`` float64: layer ``l``'s cross-attention (mean over heads, rows
        renormalised) times ``encoder_rollout``.
    """
    att = stack_layers(cross_attentions)  # (L, h, s_t, s_src)
    s_src = att.shape[-1]
    if tuple(encoder_rollout.shape) != (s_src, s_src):
        raise ValueError(f"the encoder rollout is {tuple(encoder_rollout.shape)}; the cross-attention has {s_src} keys")
    mean = att.mean(1)  # (L, s_t, s_src)
    mean = mean / mean.sum(-1, keepdim=True).clamp(min=1e-12)
    return mean @ encoder_rollout.to(torch.float64)


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
    att, cross = stack_layers(view.attentions), view.cross
    delimiters = delimiter_indices(view.keys) if delimiters is None else list(delimiters)
    stats = head_stats(att, delimiters=delimiters, cross=cross)
    fields: dict[str, object] = {
        "stats": {name: rounded(value) for name, value in stats.items()},
        "delimiters": delimiters,
        "labels": head_labels(stats, entropy_ratio(att)),
    }
    # a long input's rollout (more than FULL_WEIGHTS_LIMIT weights) in its reduced form (qkv.viz.long_inputs)
    if not cross:
        fields["rollout"] = weights_field(rollout(att))
    elif encoder_rollout is not None:
        fields["rollout"] = weights_field(cross_rollout(att, encoder_rollout))
    return fields
