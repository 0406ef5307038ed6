"""The logit lens: what each layer's hidden state would predict, and the model's candidate tokens.

The residual stream at every depth (the input of the first block, then the output of each block)
is read with forward hooks during one ordinary forward pass, and each is turned into a next-token
distribution the way the model turns its last one: the final norm (the decoder's ``norm``, which
pre-LN models have; a post-LN model's blocks end in their own norm and it has none), then the
output projection (for a :class:`~qkv.CausalLM`, :meth:`~qkv.CausalLM.logits`, soft-cap included),
then a softmax (nostalgebraist 2020, "interpreting GPT: the logit lens"). The last row is therefore
the model's own output: its candidate tokens.

* :func:`causal_lm_lens`: a language model over a text.
* :func:`decoder_lens`: a translation model's decoder over its (teacher-forced) target.

An example's ``lens`` field (:func:`lens_field`, checked by :func:`check_lens`)::

    {"about": str, "first": int, the first position's index in the text,
     "positions": [s] input tokens, "next": [s] the token that came next or null,
     "layers": [L + 1] names ("embeddings", "layer 0", ... "layer L-1"; the last: the model's output),
     "vocabulary": [str] labels of the tokens listed, "token_ids": [int] their ids,
     "top": [L + 1][s][k] indices into "vocabulary", most likely first,
     "probs": [L + 1][s][k] their probabilities, "next_probs": [L + 1][s] the next token's (null
     where "next" is)}

``k`` is at most :data:`TOP_K` and ``s`` at most :data:`MAX_POSITIONS` (a longer text: its last
positions, ``first`` saying where they start); probabilities keep 4 significant digits.

Shape legend: ``L`` layers, ``s`` positions, ``d`` width, ``V`` vocabulary, ``k`` listed tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor, nn

from qkv.viz.saliency import significant

if TYPE_CHECKING:
    from qkv.models.causal_lm import CausalLM
    from qkv.models.transformer import Transformer

TOP_K = 5  # tokens listed per layer and position
# the most positions read (a text's last ones): each costs one output projection per depth, (L + 1) V d
# products, so a long text of a large-vocabulary model would cost more than its forward pass
MAX_POSITIONS = 128
ROWS_AT_ONCE = 256  # positions projected to the vocabulary together (a (256, V) float32 block)

Labeler = Callable[[Sequence[int]], list[str]]  # token ids -> one readable label each


def residual_stream(layers: nn.ModuleList, run: Callable[[], object]) -> list[Tensor]:
    """The hidden states entering the first of ``layers`` and leaving each, during ``run()``.

    Args:
        layers: a stack's blocks, each called with the hidden states as its first argument and
            returning a :class:`~qkv.nn.layers.LayerOutput` (``.output``).
        run: calls the model once (batch of one).

    Returns:
        ``L + 1`` detached ``(s, d)`` tensors of the first row of the batch.
    """
    stream: list[Tensor] = []

    def before(module: nn.Module, args: tuple[Any, ...]) -> None:
        stream.append(args[0][0].detach())

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        stream.append(output.output[0].detach())

    handles = [layers[0].register_forward_pre_hook(before)]
    handles += [layer.register_forward_hook(after) for layer in layers]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    if len(stream) != len(layers) + 1:
        raise RuntimeError(f"read {len(stream)} hidden states from {len(layers)} layers in one forward pass")
    return stream


def lens_probs(
    stream: Sequence[Tensor],
    to_logits: Callable[[Tensor], Tensor],
    *,
    next_ids: Sequence[int | None],
    k: int = TOP_K,
) -> tuple[Tensor, Tensor, Tensor]:
    """Each depth's most likely tokens and the next token's probability.

    Args:
        stream: ``L + 1`` hidden states ``(s, d)`` from :func:`residual_stream`.
        to_logits: ``(n, d) -> (n, V)``: the final norm and the output projection.
        next_ids: ``s`` ids, the token that came next at each position (None: none did).
        k: how many tokens per depth and position.

    Returns:
        ``(L + 1, s, k)`` ids, ``(L + 1, s, k)`` their probabilities and ``(L + 1, s)`` the next
        token's probability (0 where there is none), float64.
    """
    s = stream[0].size(0)
    if len(next_ids) != s:
        raise ValueError(f"{len(next_ids)} next tokens for {s} positions")
    known = torch.tensor([i is not None for i in next_ids], device=stream[0].device)
    nexts = torch.tensor([0 if i is None else int(i) for i in next_ids], device=stream[0].device)
    ids, probs, nexts_p = [], [], []
    with torch.no_grad():
        for hidden in stream:
            parts = []
            for start in range(0, s, ROWS_AT_ONCE):
                rows = slice(start, start + ROWS_AT_ONCE)
                logits = to_logits(hidden[rows])
                p = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (n, V)
                top = p.topk(min(k, p.size(-1)), dim=-1)
                picked = p.gather(-1, nexts[rows, None])[:, 0] * known[rows]
                parts.append((top.indices, top.values, picked))
            ids.append(torch.cat([part[0] for part in parts]))
            probs.append(torch.cat([part[1] for part in parts]))
            nexts_p.append(torch.cat([part[2] for part in parts]))
    return torch.stack(ids).cpu(), torch.stack(probs).double().cpu(), torch.stack(nexts_p).double().cpu()


def lens_field(
    *,
    about: str,
    first: int,
    positions: Sequence[str],
    next_ids: Sequence[int | None],
    top_ids: Tensor,
    top_probs: Tensor,
    next_probs: Tensor,
    label: Labeler,
) -> dict[str, object]:
    """An example's ``lens`` field (layout in the module docstring) from :func:`lens_probs`' tensors.

    Args:
        about: what each position predicts, e.g. ``"the next token"``.
        first: the first position's index in the text.
        positions: the input token at each position.
        next_ids: the token that came next at each position, or None.
        top_ids, top_probs, next_probs: from :func:`lens_probs`.
        label: readable labels of token ids.
    """
    depth = top_ids.size(0)
    ids = sorted({int(i) for i in top_ids.flatten().tolist()} | {int(i) for i in next_ids if i is not None})
    index = {token: n for n, token in enumerate(ids)}
    vocabulary = label(ids)
    has_next = [i is not None for i in next_ids]
    return {
        "about": about,
        "first": first,
        "positions": list(positions),
        "next": [vocabulary[index[int(i)]] if i is not None else None for i in next_ids],
        "layers": ["embeddings"] + [f"layer {layer}" for layer in range(depth - 1)],
        "vocabulary": vocabulary,
        "token_ids": ids,
        "top": [[[index[int(i)] for i in row] for row in layer] for layer in top_ids.tolist()],
        "probs": significant(top_probs),
        "next_probs": [
            [significant(p) if ok else None for p, ok in zip(layer, has_next)] for layer in next_probs.tolist()
        ],
    }


def _final_norm(norm: nn.Module | None) -> Callable[[Tensor], Tensor]:
    return (lambda h: h) if norm is None else norm


def causal_lm_lens(model: CausalLM, ids: Tensor, label: Labeler, *, k: int = TOP_K) -> dict[str, object]:
    """The logit lens of a language model over a text.

    Args:
        model: the language model (in eval mode).
        ids: ``(1, s)`` token ids within its context.
        label: readable labels of token ids.
        k: tokens listed per layer and position.

    Returns:
        The ``lens`` field over the text's last :data:`MAX_POSITIONS` positions; position ``i``
        predicts token ``i + 1`` (the last position: the token after the text, whose ``next`` is null).
    """
    norm = _final_norm(model.decoder.norm)
    with torch.no_grad():
        stream = residual_stream(model.decoder.layers, lambda: model(ids, project=False))
    row = [int(i) for i in ids[0].tolist()]
    first = max(0, len(row) - MAX_POSITIONS)
    next_ids: list[int | None] = [*row[first + 1 :], None]
    stream = [h[first:] for h in stream]
    top_ids, top_probs, next_probs = lens_probs(stream, lambda h: model.logits(norm(h)), next_ids=next_ids, k=k)
    return lens_field(
        about="the next token",
        first=first,
        positions=label(row[first:]),
        next_ids=next_ids,
        top_ids=top_ids,
        top_probs=top_probs,
        next_probs=next_probs,
        label=label,
    )


def decoder_lens(
    model: Transformer, src: Tensor, tgt_in: Tensor, predicted: Sequence[int], label: Labeler, *, k: int = TOP_K
) -> dict[str, object]:
    """The logit lens of a translation model's decoder over a teacher-forced target.

    Args:
        model: the :class:`~qkv.Transformer` (in eval mode).
        src: ``(1, s_src)`` source ids.
        tgt_in: ``(1, s_t)`` decoder input ids (BOS then the target).
        predicted: ``s_t`` ids, what each decoder position predicts (the target shifted by one,
            ending with EOS).
        label: readable labels of target token ids.
        k: tokens listed per layer and position.

    Returns:
        The ``lens`` field over the decoder positions (the last :data:`MAX_POSITIONS`).
    """
    if len(predicted) != tgt_in.size(1):
        raise ValueError(f"{len(predicted)} predicted tokens for {tgt_in.size(1)} decoder positions")
    norm = _final_norm(model.decoder.norm)
    with torch.no_grad():
        memory = model.encode(src)
        stream = residual_stream(model.decoder.layers, lambda: model.decode(tgt_in, memory, project=False))
    first = max(0, len(predicted) - MAX_POSITIONS)
    next_ids: list[int | None] = [int(i) for i in predicted[first:]]
    stream = [h[first:] for h in stream]
    top_ids, top_probs, next_probs = lens_probs(stream, lambda h: model.output_proj(norm(h)), next_ids=next_ids, k=k)
    return lens_field(
        about="the next target token",
        first=first,
        positions=label([int(i) for i in tgt_in[0, first:].tolist()]),
        next_ids=next_ids,
        top_ids=top_ids,
        top_probs=top_probs,
        next_probs=next_probs,
        label=label,
    )


def _fail(where: str, message: str) -> NoReturn:
    raise ValueError(f"{where}: {message}")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _strings(value: object, optional: bool = False) -> bool:
    return isinstance(value, list) and all(isinstance(t, str) or (optional and t is None) for t in value)


def check_lens(lens: object, where: str) -> None:
    """Check an example's ``lens`` field (layout in the module docstring); a one-line ValueError
    naming ``where`` and the key that is wrong."""
    if not isinstance(lens, dict):
        _fail(where, "must be an object")
    keys = ("about", "first", "positions", "next", "layers", "vocabulary", "token_ids", "top", "probs", "next_probs")
    for key in keys:
        if key not in lens:
            _fail(where, f"has no {key!r}")
    if not isinstance(lens["about"], str):
        _fail(where, "'about' must be a string")
    for key in ("positions", "layers", "vocabulary"):
        if not _strings(lens[key]):
            _fail(where, f"{key!r} must be a list of strings")
    first = lens["first"]
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        _fail(where, f"'first' must be a position (a non-negative integer), got {str(first)[:40]}")
    depth, s, n = len(lens["layers"]), len(lens["positions"]), len(lens["vocabulary"])
    if not _strings(lens["next"], optional=True) or len(lens["next"]) != s:
        _fail(where, f"'next' must be {s} strings or nulls (one per position)")
    ids = lens["token_ids"]
    if (
        not isinstance(ids, list)
        or len(ids) != n
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        _fail(where, f"'token_ids' must be {n} integers (one per vocabulary entry)")
    top, probs = lens["top"], lens["probs"]
    if not isinstance(top, list) or len(top) != depth or not top:
        _fail(where, f"'top' must be [{depth}][{s}][k]")
    k = len(top[0][0]) if s and isinstance(top[0], list) and top[0] and isinstance(top[0][0], list) else 0
    for name, grid, leaf, what in (
        ("top", top, lambda x: isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n, "vocabulary indices"),
        ("probs", probs, lambda x: _is_number(x) and 0 <= x <= 1, "probabilities"),
    ):
        ok = isinstance(grid, list) and len(grid) == depth
        ok = ok and all(isinstance(layer, list) and len(layer) == s for layer in grid)
        ok = ok and all(
            isinstance(row, list) and len(row) == k and all(map(leaf, row)) for layer in grid for row in layer
        )
        if not ok or (s and not 1 <= k <= TOP_K):
            _fail(where, f"{name!r} must be [{depth}][{s}][k] (k from 1 to {TOP_K}) of {what}")
    has_next = [t is not None for t in lens["next"]]
    grid = lens["next_probs"]
    if not (
        isinstance(grid, list)
        and len(grid) == depth
        and all(
            isinstance(layer, list)
            and len(layer) == s
            and all((p is None) if not ok else (_is_number(p) and 0 <= p <= 1) for p, ok in zip(layer, has_next))
            for layer in grid
        )
    ):
        _fail(where, f"'next_probs' must be [{depth}][{s}] probabilities, null where 'next' is")
