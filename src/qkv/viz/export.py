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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from qkv.fileio import write_text

FORMAT = "qkv-attention/1"


@dataclass
class AttentionView:
    """One kind of attention of one input.

    Args:
        name: what the view shows, e.g. ``"encoder self-attention"``.
        queries: the tokens that attend (rows).
        keys: the tokens attended to (columns).
        attentions: one tensor per layer, ``(h, s_q, s_k)`` or ``(1, h, s_q, s_k)``.

    Raises:
        ValueError: a layer's shape disagrees with the token counts or with the other layers.
    """

    name: str
    queries: list[str]
    keys: list[str]
    attentions: list[Tensor]

    def __post_init__(self) -> None:
        self.queries, self.keys = [str(t) for t in self.queries], [str(t) for t in self.keys]
        if not self.attentions:
            raise ValueError(f"view {self.name!r}: no attention layers")
        layers = []
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
        return len(self.attentions)

    @property
    def num_heads(self) -> int:
        return self.attentions[0].size(0)

    def to_dict(self, decimals: int = 4) -> dict:
        """JSON-ready dict; weights rounded to ``decimals`` places to keep the HTML small."""
        return {
            "name": self.name,
            "queries": self.queries,
            "keys": self.keys,
            "layers": self.num_layers,
            "heads": self.num_heads,
            "attention": [a.round(decimals=decimals).tolist() for a in self.attentions],
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
    """Validate a document (e.g. one read back from JSON) against the contract; one-line ValueError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} document")
    for e, example in enumerate(data.get("examples") or []):
        for view in example.get("views") or []:
            att, q, k = view["attention"], view["queries"], view["keys"]
            if len(att) != view["layers"] or any(len(layer) != view["heads"] for layer in att):
                raise ValueError(f"example {e} view {view['name']!r}: layers/heads disagree with the attention array")
            for layer in att:
                for head in layer:
                    if len(head) != len(q) or any(len(row) != len(k) for row in head):
                        raise ValueError(
                            f"example {e} view {view['name']!r}: attention rows/columns disagree with "
                            f"{len(q)} query and {len(k)} key tokens"
                        )


def write_json(data: dict, path: str | Path) -> Path:
    """Write the document as compact UTF-8 JSON, atomically (see :mod:`qkv.fileio`)."""
    return write_text(path, json.dumps(data, ensure_ascii=False))
