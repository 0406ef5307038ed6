"""Two sentences side by side: which heads treat the tokens the sentences share most differently.

The tokens that are the same string in both sentences are matched in order
(:func:`shared_tokens`: :class:`difflib.SequenceMatcher`'s matching blocks, so the matching never
crosses itself). For one layer and head, each shared token's attention row is read as a
distribution over the shared tokens plus one bucket for all the other tokens of its sentence
(what it gives to the words the sentences do not share, pooled); the difference of that token is
the total-variation distance between its two distributions, ``0.5 * sum |p - q|`` (0: the same,
1: nothing in common), and the head's difference is the mean over the shared tokens.

For "time flies like an arrow" / "fruit flies like a banana" with a BERT tokenizer the shared
tokens are ``[CLS] flies like [SEP]``; a head whose "flies" row moves weight from "like" to
"time"/"fruit" (pooled: the words not shared) scores high on "flies".
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from qkv.viz.long_inputs import is_reduced

MEASURE = (
    "mean over the shared tokens of the total-variation distance between their attention rows, "
    "each read over the shared tokens plus one bucket for all other tokens"
)
DECIMALS = 4


def shared_tokens(a: Sequence[str], b: Sequence[str]) -> list[list[int]]:
    """Pairs ``[i, j]`` with ``a[i] == b[j]``, in order in both (longest matching blocks first)."""
    matcher = difflib.SequenceMatcher(a=list(a), b=list(b), autojunk=False)
    return [[block.a + k, block.b + k] for block in matcher.get_matching_blocks() for k in range(block.size)]


def token_differences(attention_a: Tensor, attention_b: Tensor, pairs: Sequence[Sequence[int]]) -> Tensor:
    """The total-variation distance of each shared token's attention, per layer and head.

    Args:
        attention_a: ``(L, h, s_a, s_a)`` self-attention of the first sentence.
        attention_b: ``(L, h, s_b, s_b)`` of the second (same ``L`` and ``h``).
        pairs: from :func:`shared_tokens`.

    Returns:
        ``(L, h, n_shared)`` float64 in [0, 1].
    """
    if attention_a.shape[:2] != attention_b.shape[:2]:
        raise ValueError(
            f"the two views have {tuple(attention_a.shape[:2])} and {tuple(attention_b.shape[:2])} (layers, heads)"
        )
    if not pairs:
        raise ValueError("the two sentences share no token")
    index_a = torch.tensor([p[0] for p in pairs])
    index_b = torch.tensor([p[1] for p in pairs])
    dists = []
    for att, index in ((attention_a, index_a), (attention_b, index_b)):
        att = att.to(torch.float64)
        shared = att.index_select(-2, index).index_select(-1, index)  # (L, h, n, n)
        others = (att.index_select(-2, index).sum(-1) - shared.sum(-1)).clamp(min=0)  # (L, h, n)
        dists.append(torch.cat([shared, others[..., None]], dim=-1))  # (L, h, n, n + 1)
    return 0.5 * (dists[0] - dists[1]).abs().sum(-1)


def _view(example: dict, name: str, which: int) -> dict:
    for view in example.get("views") or []:
        if view["name"] == name:
            return view
    raise ValueError(f"example {which} has no view {name!r}")


def compare_field(examples: Sequence[dict], first: int = 0, second: int = 1, *, view: str | None = None) -> dict:
    """The document's ``compare`` field for two of its examples (see :mod:`qkv.viz.export`).

    Args:
        examples: the document's examples (from :func:`~qkv.viz.export.make_example`).
        first, second: the two examples' indices.
        view: the self-attention view compared (default: the first example's first view).

    Returns:
        ``{"examples", "view", "shared", "heads", "measure"}``; ``heads`` lists every layer and
        head with its ``difference`` (and ``per_token``, one number per shared pair), largest first.

    Raises:
        ValueError: an index out of range, a view that is missing or not self-attention, views of
            different sizes, a view too long to carry every weight, or no shared token.
    """
    for index in (first, second):
        if not 0 <= index < len(examples):
            raise ValueError(f"example index {index} is out of range for {len(examples)} examples")
    if first == second:
        raise ValueError(f"compare needs two different examples, got {first} twice")
    name = view if view is not None else examples[first]["views"][0]["name"]
    view_a, view_b = _view(examples[first], name, first), _view(examples[second], name, second)
    for which, v in ((first, view_a), (second, view_b)):
        if is_reduced(v["attention"]):
            raise ValueError(
                f"example {which} view {name!r} has {len(v['queries'])} tokens, too long to carry every weight "
                "(docs/explorer.md, Long inputs); compare needs them all: compare shorter texts"
            )
        if v["queries"] != v["keys"]:
            raise ValueError(f"example {which} view {name!r} is not self-attention; compare needs queries == keys")
    pairs = shared_tokens(view_a["queries"], view_b["queries"])
    per_token = token_differences(
        torch.tensor(view_a["attention"], dtype=torch.float64),
        torch.tensor(view_b["attention"], dtype=torch.float64),
        pairs,
    )  # (L, h, n)
    heads: list[dict[str, Any]] = [
        {
            "layer": layer,
            "head": head,
            "difference": round(float(per_token[layer, head].mean()), DECIMALS),
            "per_token": per_token[layer, head].round(decimals=DECIMALS).tolist(),
        }
        for layer in range(per_token.size(0))
        for head in range(per_token.size(1))
    ]
    heads.sort(key=lambda row: -row["difference"])  # stable: ties keep layer, head order
    return {"examples": [first, second], "view": name, "shared": pairs, "heads": heads, "measure": MEASURE}
