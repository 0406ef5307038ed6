"""The explorer's data contract: attention views as plain JSON.

A view is one kind of attention of one sentence (encoder self-attention, decoder self-attention,
cross-attention): the query tokens, the key tokens and, per layer, a ``(h, s_q, s_k)`` array.
Sizes are checked when a view is made, so a tokens-versus-attention mismatch is a clear
one-line error here, never a broken drawing in the browser.

JSON layout (``format: "qkv-attention/1"``)::

    {"format": "qkv-attention/1", "title": str,
     "examples": [{"text": str, "model": str, "output": str | null,
                   "views": [{"name": str, "queries": [str], "keys": [str],
                              "layers": L, "heads": H,
                              "attention": [L][H][s_q][s_k] floats}]}]}

Optional fields (the explorers fill them; a document without them still draws; computed by
:mod:`qkv.viz.analysis`, :mod:`qkv.viz.saliency`, :mod:`qkv.viz.compare`, :mod:`qkv.viz.corpus`,
where each is defined exactly)::

    view["stats"]       {name: [L][H] floats}: self-attention "entropy" (nats), "previous",
                        "same", "next" (weight on key i-1 / i / i+1), "delimiter" (weight on the
                        keys in "delimiters"), "distance" (mean |i - j|); cross-attention
                        "entropy", "delimiter", "distance" (from the scaled diagonal). Each is
                        averaged over the query rows.
    view["delimiters"]  [int]: the key positions counted as delimiters ([CLS]/[SEP], <s>/</s>, ...).
    view["labels"]      [L][H] of "previous-token head" | "same-token head" | "next-token head" |
                        "delimiter head" | "broad head" | null.
    view["rollout"]     [L][s_q][s_k]: attention rollout through layers 0..l (Abnar & Zuidema
                        2020); for cross-attention, layer l's cross-attention through the
                        encoder's rollout (rows target tokens, columns source tokens).
    example["saliency"] {"about": str, "inputs": [str], "outputs": [str],
                         "scores": [n_out][n_in] (gradient x input, signed),
                         "attention": [n_out][n_in] (the same outputs' attention weights)}.
    example["lens"]     the logit lens: each layer's top tokens per position (qkv.viz.lens).
    example["attribution"] each generated token's gradient x input and rollout over its context
                        (qkv.viz.attribution).
    data["compare"]     {"examples": [i, j], "view": str, "shared": [[a, b], ...],
                         "heads": [{"layer": l, "head": h, "difference": float,
                                    "per_token": [float per shared pair]}, ...] largest first,
                         "measure": str}.
    data["corpus"]      {"file": str, "sentences": int,
                         "views": {view name: {"stats": {...}, "labels": [L][H]}}}.

Long inputs: a view of more than ``qkv.viz.long_inputs.FULL_WEIGHTS_LIMIT`` weights has, in place of
the nested lists of ``"attention"`` (and of ``"rollout"``), their reduced form
``{"reduced": "qkv-reduced/1", ...}``: each row's largest weights and block means
(:mod:`qkv.viz.long_inputs`).

Cross-attention rows are labelled by the token each decoder position predicts (the decoder's
input shifted by one, ending with </s>); token labels show spaces and control characters (a
byte-level BPE token's leading space is "␣").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from qkv.runtime.fileio import write_text
from qkv.viz.analysis import BROAD_LABEL, LABELS
from qkv.viz.attribution import check_fields as check_lens_and_attribution
from qkv.viz.long_inputs import check_reduced, reduce_weights, too_large

FORMAT = "qkv-attention/1"


@dataclass
class AttentionView:
    """One kind of attention of one input.

    Args:
        name: what the view shows, e.g. ``"encoder self-attention"``.
        queries: the tokens that attend (rows).
        keys: the tokens attended to (columns).
        attentions: one tensor per layer, ``(h, s_q, s_k)`` or ``(1, h, s_q, s_k)``.
        cross: the queries and keys are different sequences (cross-attention); the head
            statistics then leave out previous/same/next (see :mod:`qkv.viz.analysis`).

    Raises:
        ValueError: a layer's shape disagrees with the token counts or with the other layers.
    """

    name: str
    queries: list[str]
    keys: list[str]
    attentions: list[Tensor]
    cross: bool = False

    def __post_init__(self) -> None:
        self.queries, self.keys = [str(t) for t in self.queries], [str(t) for t in self.keys]
        if not self.attentions:
            raise ValueError(f"view {self.name!r}: no attention layers")
        layers: list[Tensor] = []
        for i, a in enumerate(self.attentions):
            if a is None:
                raise ValueError(f"view {self.name!r}: layer {i} has no attention weights (was need_weights set?)")
            if a.dim() == 4 and a.size(0) == 1:
                a = a[0]  # (h, s_q, s_k)
            if a.dim() != 3:
                raise ValueError(
                    f"view {self.name!r}: layer {i} attention must be (heads, s_q, s_k) for one input, "
                    f"got shape {tuple(a.shape)}"
                )
            if a.shape[1:] != (len(self.queries), len(self.keys)):
                raise ValueError(
                    f"view {self.name!r}: layer {i} attention is {tuple(a.shape)} (heads, s_q, s_k) but there are "
                    f"{len(self.queries)} query tokens and {len(self.keys)} key tokens"
                )
            if layers and a.size(0) != layers[0].size(0):
                raise ValueError(
                    f"view {self.name!r}: layer {i} has {a.size(0)} heads, layer 0 has {layers[0].size(0)}"
                )
            layers.append(a.detach().float().cpu())
        self.attentions = layers

    @property
    def num_layers(self) -> int:
        """The number of layers with attention weights."""
        return len(self.attentions)

    @property
    def num_heads(self) -> int:
        """The number of heads of each layer."""
        return self.attentions[0].size(0)

    def to_dict(self, decimals: int = 4) -> dict:
        """JSON-ready dict; weights rounded to ``decimals`` places to keep the HTML small. A view of
        more than :data:`qkv.viz.long_inputs.FULL_WEIGHTS_LIMIT` weights (a long input) gets their
        reduced form instead (:func:`qkv.viz.long_inputs.reduce_weights`: each row's largest weights
        and block means)."""
        shape = (self.num_layers, *self.attentions[0].shape)
        if too_large(shape):
            attention: list | dict = reduce_weights(self.attentions)
        else:  # float64: short JSON
            attention = [a.double().round(decimals=decimals).tolist() for a in self.attentions]
        return {
            "name": self.name,
            "queries": self.queries,
            "keys": self.keys,
            "layers": self.num_layers,
            "heads": self.num_heads,
            "attention": attention,
        }


def check_text(text: str) -> None:
    """An explorer's input text: ``ValueError`` when it is empty or not a string."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the text is empty")


def make_example(text: str, views: Sequence[AttentionView], *, model: str = "", output: str | None = None) -> dict:
    """One input of the explorer: its text, the model's name, an output text (e.g. a translation)
    and its views."""
    if not views:
        raise ValueError(f"example {text!r}: no views")
    return {"text": text, "model": model, "output": output, "views": [v.to_dict() for v in views]}


def explorer_data(examples: Sequence[dict], *, title: str = "qkv attention explorer") -> dict:
    """The document the explorer renders: a title and examples from :func:`make_example`."""
    if not examples:
        raise ValueError("no examples to show")
    return {"format": FORMAT, "title": title, "examples": list(examples)}


def check_data(data: dict) -> None:
    """Validate a document (e.g. one read back from JSON) against the contract, the optional fields
    included; a one-line ValueError naming the example, view and field that is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} document")
    examples = data.get("examples") or []
    for e, example in enumerate(examples):
        for view in example.get("views") or []:
            att, q, k = view["attention"], view["queries"], view["keys"]
            if isinstance(att, dict):  # a long input's reduced form (qkv.viz.long_inputs)
                shape = (view["layers"], view["heads"], len(q), len(k))
                check_reduced(att, shape, f"example {e} view {view['name']!r}: 'attention'")
                _check_view_analysis(view, f"example {e} view {view['name']!r}")
                continue
            if len(att) != view["layers"] or any(len(layer) != view["heads"] for layer in att):
                raise ValueError(f"example {e} view {view['name']!r}: layers/heads disagree with the attention array")
            for layer in att:
                for head in layer:
                    if len(head) != len(q) or any(len(row) != len(k) for row in head):
                        raise ValueError(
                            f"example {e} view {view['name']!r}: attention rows/columns disagree with "
                            f"{len(q)} query and {len(k)} key tokens"
                        )
            _check_view_analysis(view, f"example {e} view {view['name']!r}")
        if "saliency" in example:
            _check_saliency(example["saliency"], f"example {e} 'saliency'")
        check_lens_and_attribution(example, f"example {e}")  # the optional "lens" and "attribution"
    if "compare" in data:
        _check_compare(data["compare"], examples)
    if "corpus" in data:
        _check_corpus(data["corpus"])


HEAD_LABELS = (*LABELS.values(), BROAD_LABEL)  # what a head label may be (qkv.viz.analysis)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _check_grid(
    grid: object,
    shape: tuple[int, ...],
    where: str,
    *,
    item: Callable[[object], bool] = _is_number,
    what: str = "numbers",
) -> None:
    """``grid`` is nested lists of ``shape`` whose leaves pass ``item``."""

    def walk(node: object, depth: int) -> bool:
        if depth == len(shape):
            return item(node)
        return isinstance(node, list) and len(node) == shape[depth] and all(walk(n, depth + 1) for n in node)

    if not walk(grid, 0):
        raise ValueError(f"{where} must be {' x '.join(map(str, shape))} nested lists of {what}")


def _check_weight_grid(grid: object, shape: tuple[int, ...], where: str) -> None:
    """:func:`_check_grid` of numbers for large grids (a 2,048-token rollout has 16.8 million
    weights): read by numpy at once instead of one by one in Python."""
    try:
        values = np.asarray(grid, dtype=np.float64)
    except (TypeError, ValueError):
        values = None  # ragged, or not numbers
    if values is None or values.shape != shape or not np.isfinite(values).all():
        raise ValueError(f"{where} must be {' x '.join(map(str, shape))} nested lists of numbers")


def _check_view_analysis(view: dict[str, Any], where: str) -> None:
    layers, heads, s_q, s_k = view["layers"], view["heads"], len(view["queries"]), len(view["keys"])
    if "stats" in view:
        if not isinstance(view["stats"], dict) or not view["stats"]:
            raise ValueError(f"{where}: 'stats' must be an object of statistic name -> [layers][heads]")
        for name, grid in view["stats"].items():
            _check_grid(grid, (layers, heads), f"{where}: 'stats'[{name!r}]")
    if "delimiters" in view:
        bad = view["delimiters"]
        if not isinstance(bad, list) or not all(isinstance(d, int) and 0 <= d < s_k for d in bad):
            raise ValueError(f"{where}: 'delimiters' must be key positions below {s_k}, got {str(bad)[:80]}")
    if "labels" in view:
        _check_grid(
            view["labels"],
            (layers, heads),
            f"{where}: 'labels'",
            item=lambda x: x is None or x in HEAD_LABELS,
            what=f"null or one of {', '.join(HEAD_LABELS)}",
        )
    if "rollout" in view and isinstance(view["rollout"], dict):
        check_reduced(view["rollout"], (layers, s_q, s_k), f"{where}: 'rollout'")
    elif "rollout" in view:
        _check_weight_grid(view["rollout"], (layers, s_q, s_k), f"{where}: 'rollout'")


def _check_saliency(saliency: object, where: str) -> None:
    if not isinstance(saliency, dict):
        raise ValueError(f"{where} must be an object")
    for key in ("about", "inputs", "outputs", "scores", "attention"):
        if key not in saliency:
            raise ValueError(f"{where} has no {key!r}")
    if not isinstance(saliency["about"], str):
        raise ValueError(f"{where}: 'about' must be a string")
    for key in ("inputs", "outputs"):
        if not isinstance(saliency[key], list) or not all(isinstance(t, str) for t in saliency[key]):
            raise ValueError(f"{where}: {key!r} must be a list of strings")
    shape = (len(saliency["outputs"]), len(saliency["inputs"]))
    for key in ("scores", "attention"):
        _check_grid(saliency[key], shape, f"{where}: {key!r}")


def _check_compare(compare: object, examples: list[dict[str, Any]]) -> None:
    where = "'compare'"
    if not isinstance(compare, dict):
        raise ValueError(f"{where} must be an object")
    pair = compare.get("examples")
    if (
        not isinstance(pair, list)
        or len(pair) != 2
        or not all(isinstance(i, int) and 0 <= i < len(examples) for i in pair)
    ):
        raise ValueError(f"{where}: 'examples' must be two indices below {len(examples)}, got {str(pair)[:80]}")
    name = compare.get("view")
    found = [next((v for v in examples[i].get("views") or [] if v["name"] == name), None) for i in pair]
    views = [v for v in found if v is not None]
    if not isinstance(name, str) or len(views) < 2:
        raise ValueError(f"{where}: 'view' must name a view of both examples, got {str(name)[:80]!r}")
    shared = compare.get("shared")
    sizes = [len(v["queries"]) for v in views]
    if not isinstance(shared, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(i, int) and 0 <= i < n for i, n in zip(p, sizes))
        for p in shared
    ):
        raise ValueError(f"{where}: 'shared' must be [a, b] token pairs within {sizes[0]} and {sizes[1]} tokens")
    heads = compare.get("heads")
    layers, count = views[0]["layers"], views[0]["heads"]
    if not isinstance(heads, list) or not all(
        isinstance(h, dict)
        and isinstance(h.get("layer"), int)
        and 0 <= h["layer"] < layers
        and isinstance(h.get("head"), int)
        and 0 <= h["head"] < count
        and _is_number(h.get("difference"))
        for h in heads
    ):
        raise ValueError(
            f"{where}: 'heads' must be objects with 'layer' < {layers}, 'head' < {count} and a number 'difference'"
        )
    if not isinstance(compare.get("measure"), str):
        raise ValueError(f"{where}: 'measure' must be a string")


def _check_corpus(corpus: object) -> None:
    where = "'corpus'"
    if not isinstance(corpus, dict) or not isinstance(corpus.get("file"), str):
        raise ValueError(f"{where} must be an object with a string 'file'")
    sentences = corpus.get("sentences")
    if not isinstance(sentences, int) or isinstance(sentences, bool) or sentences < 1:
        raise ValueError(f"{where}: 'sentences' must be a positive integer, got {str(sentences)[:40]}")
    views = corpus.get("views")
    if not isinstance(views, dict):
        raise ValueError(f"{where}: 'views' must be an object of view name -> stats and labels")
    for name, entry in views.items():
        stats = entry.get("stats") if isinstance(entry, dict) else None
        if not isinstance(stats, dict) or not stats:
            raise ValueError(f"{where} view {name!r}: 'stats' must be an object of statistic name -> [layers][heads]")
        grid = next(iter(stats.values()))
        shape = (len(grid), len(grid[0]) if isinstance(grid, list) and grid and isinstance(grid[0], list) else 0)
        for stat, grid in stats.items():
            _check_grid(grid, shape, f"{where} view {name!r}: 'stats'[{stat!r}]")
        if "labels" in entry:
            _check_grid(
                entry["labels"],
                shape,
                f"{where} view {name!r}: 'labels'",
                item=lambda x: x is None or x in HEAD_LABELS,
                what=f"null or one of {', '.join(HEAD_LABELS)}",
            )


def write_json(data: dict, path: str | Path) -> Path:
    """Write the document as compact UTF-8 JSON, atomically (see :mod:`qkv.runtime.fileio`)."""
    return write_text(path, json.dumps(data, ensure_ascii=False))
