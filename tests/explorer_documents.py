"""Explorer documents in the shape of the contract (issue 15), made here for the page's tests and the
draw benchmark: random attention with a few heads set by hand, and the analysis fields (stats,
labels, rollout, saliency, compare, corpus) computed from it with plain numpy loops. The page only
draws these numbers, so what matters is that they have the contract's shapes and known values.
"""

from __future__ import annotations

import numpy as np
import torch

from qkv.viz import AttentionView, explorer_data, make_example

DELIMITERS = ("[CLS]", "[SEP]", "<s>", "</s>")
FRACTION_STATS = ("previous", "same", "next", "delimiter")


def random_attention(rng: np.random.Generator, n: int, *, sharpness: float = 3.0) -> np.ndarray:
    """Rows that sum to 1, ``(n, n)``."""
    logits = rng.normal(size=(n, n)) * sharpness
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def shifted(n: int, offset: int) -> np.ndarray:
    """A head that puts 0.9 on token i + offset (where it exists) and spreads the rest."""
    weights = np.full((n, n), 0.1 / n)
    for i in range(n):
        j = min(max(i + offset, 0), n - 1)
        weights[i, j] += 0.9
    return weights / weights.sum(axis=1, keepdims=True)


def head_stats(att: np.ndarray, delimiters: list[int]) -> dict[str, float]:
    """The contract's statistics of one self-attention head ``(s, s)``, averaged over the query rows."""
    n = att.shape[0]
    rows = np.arange(n)
    logs = np.log(np.where(att > 0, att, 1.0))
    return {
        "entropy": float(-(att * logs).sum(axis=1).mean()),
        "previous": float(att[rows[1:], rows[1:] - 1].sum() / n),
        "same": float(att[rows, rows].mean()),
        "next": float(att[rows[:-1], rows[:-1] + 1].sum() / n),
        "delimiter": float(att[:, delimiters].sum() / n),
        "distance": float((att * np.abs(rows[:, None] - rows[None, :])).sum(axis=1).mean()),
    }


def head_label(stats: dict[str, float], n: int) -> str | None:
    """The pattern that dominates (over half the attention), a broad head, or None."""
    best = max(FRACTION_STATS, key=lambda k: stats[k])
    if stats[best] > 0.5:
        return {
            "previous": "previous-token head",
            "same": "same-token head",
            "next": "next-token head",
            "delimiter": "delimiter head",
        }[best]
    if stats["entropy"] > 0.8 * np.log(n):
        return "broad head"
    return None


def rollout(layers: list[np.ndarray]) -> list[np.ndarray]:
    """Attention rollout through each layer: mean over heads, plus identity, rows renormalised, multiplied."""
    out, acc = [], None
    for att in layers:  # (h, s, s)
        a = att.mean(axis=0) + np.eye(att.shape[1])
        a = a / a.sum(axis=1, keepdims=True)
        acc = a if acc is None else a @ acc
        out.append(acc)
    return out


def rounded(array: np.ndarray) -> list:
    return np.round(np.asarray(array, dtype=np.float64), 4).tolist()


def sentence_view(
    rng: np.random.Generator, tokens: list[str], layers: int, heads: int, hand_set: dict | None = None
) -> AttentionView:
    """A self-attention view with random heads, some replaced by ``hand_set[(l, h)] = offset``."""
    n = len(tokens)
    att = []
    for layer_index in range(layers):
        layer = np.stack([random_attention(rng, n) for _ in range(heads)])
        for (hl, hh), offset in (hand_set or {}).items():
            if hl == layer_index:
                layer[hh] = shifted(n, offset)
        att.append(layer)
    return AttentionView("self-attention", tokens, tokens, [torch.tensor(a, dtype=torch.float32) for a in att])


def add_analysis(view: dict) -> None:
    """Add stats, delimiters, labels and rollout to a view dict, computed from the weights it holds
    (rounded, as the page sees them)."""
    att = [np.asarray(layer, dtype=np.float64) for layer in view["attention"]]
    tokens = view["queries"]
    delimiters = [i for i, t in enumerate(tokens) if t in DELIMITERS]
    per_head = [
        [head_stats(att[layer_index][h], delimiters) for h in range(view["heads"])]
        for layer_index in range(view["layers"])
    ]
    names = list(per_head[0][0])
    view["stats"] = {name: [[round(s[name], 4) for s in row] for row in per_head] for name in names}
    view["delimiters"] = delimiters
    view["labels"] = [[head_label(s, len(tokens)) for s in row] for row in per_head]
    view["rollout"] = [rounded(r) for r in rollout(att)]


def saliency(rng: np.random.Generator, inputs: list[str], outputs: list[str], about: str) -> dict:
    scores = rng.normal(size=(len(outputs), len(inputs)))
    attention = np.stack([random_attention(rng, len(inputs))[0] for _ in outputs])
    return {
        "about": about,
        "inputs": inputs,
        "outputs": outputs,
        "scores": rounded(scores),
        "attention": rounded(attention),
    }


def shared_pairs(a: list[str], b: list[str]) -> list[list[int]]:
    """Tokens that are the same string in both, matched in order."""
    pairs, start = [], 0
    for i, token in enumerate(a):
        for j in range(start, len(b)):
            if b[j] == token:
                pairs.append([i, j])
                start = j + 1
                break
    return pairs


def head_differences(view_a: dict, view_b: dict, pairs: list[list[int]]) -> list[dict]:
    """Every layer/head: the total-variation distance between each shared token's attention over the
    shared tokens (each renormalised), per token and its mean; largest mean first."""
    rows = []
    for layer_index in range(view_a["layers"]):
        for h in range(view_a["heads"]):
            a = np.asarray(view_a["attention"][layer_index][h])[np.ix_([p[0] for p in pairs], [p[0] for p in pairs])]
            b = np.asarray(view_b["attention"][layer_index][h])[np.ix_([p[1] for p in pairs], [p[1] for p in pairs])]
            a = a / np.maximum(a.sum(axis=1, keepdims=True), 1e-12)
            b = b / np.maximum(b.sum(axis=1, keepdims=True), 1e-12)
            per_token = 0.5 * np.abs(a - b).sum(axis=1)
            rows.append(
                {
                    "layer": layer_index,
                    "head": h,
                    "difference": round(float(per_token.mean()), 4),
                    "per_token": [round(float(v), 4) for v in per_token],
                }
            )
    return sorted(rows, key=lambda r: -r["difference"])


def seed_document(layers: int = 3, heads: int = 4, seed: int = 0) -> dict:
    """The seeds' two sentences with every field of the contract: stats, labels, rollout, saliency,
    compare and a corpus average. Layer 0 head 1 is a previous-token head, layer 1 head 0 a
    next-token head, layer 2 head 2 a same-token head."""
    rng = np.random.default_rng(seed)
    sentences = [
        ("time flies like an arrow", ["[CLS]", "time", "flies", "like", "an", "arrow", "[SEP]"]),
        ("fruit flies like a banana", ["[CLS]", "fruit", "flies", "like", "a", "banana", "[SEP]"]),
    ]
    hand_set = {(0, 1): -1, (1, 0): 1, (2, 2): 0}
    examples = []
    for text, tokens in sentences:
        view = sentence_view(rng, tokens, layers, heads, hand_set)
        examples.append(make_example(text, [view], model="synthetic"))
    data = explorer_data(examples, title="synthetic explorer document")
    for example in data["examples"]:
        add_analysis(example["views"][0])
    data["examples"][0]["saliency"] = saliency(rng, sentences[0][1], ["le", "temps", "vole"], "generated token")
    data["examples"][1]["saliency"] = saliency(
        rng, sentences[1][1], ["cosine similarity with sentence 1"], "cosine similarity with sentence 1"
    )
    va, vb = data["examples"][0]["views"][0], data["examples"][1]["views"][0]
    pairs = shared_pairs(va["queries"], vb["queries"])
    data["compare"] = {
        "examples": [0, 1],
        "view": "self-attention",
        "shared": pairs,
        "heads": head_differences(va, vb, pairs),
        "measure": "mean over shared tokens of the total-variation distance between their "
        "attention over the shared tokens",
    }
    corpus_stats = {
        name: [
            [round(v * 0.5 + 0.01 * (layer_index + h), 4) for h, v in enumerate(row)]
            for layer_index, row in enumerate(grid)
        ]
        for name, grid in va["stats"].items()
    }
    corpus_labels = [["broad head"] * heads for _ in range(layers)]
    data["corpus"] = {
        "file": "sentences.txt",
        "sentences": 40,
        "views": {"self-attention": {"stats": corpus_stats, "labels": corpus_labels}},
    }
    return data


def long_document(tokens: int = 512, layers: int = 2, heads: int = 2, seed: int = 1) -> dict:
    """One example of ``tokens`` tokens with stats, labels, rollout and saliency (a long input)."""
    rng = np.random.default_rng(seed)
    words = ["[CLS]"] + [f"w{i}" for i in range(tokens - 2)] + ["[SEP]"]
    view = sentence_view(rng, words, layers, heads, {(0, 0): -1})
    data = explorer_data([make_example(" ".join(words[1:-1]), [view], model="synthetic")], title="a long input")
    add_analysis(data["examples"][0]["views"][0])
    data["examples"][0]["saliency"] = saliency(rng, words, ["next token"], "next token")
    return data
