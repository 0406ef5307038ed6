"""Attention worked by hand, step by step, and checked against the library.

A handful of tokens with a few features go through scaled dot-product attention (section 3.2.1)
in both conventions found in textbooks:

* rows (the paper, PyTorch): one token per row; ``Q = X W_Q``; ``S = Q K^T``; softmax over each
  row; ``Z = A V``;
* columns (many lecture notes): one token per column; ``Q = W_Q X``; ``S = K^T Q``; softmax over
  each column; ``Z = V A``.

The two give transposed copies of the same numbers. Then multi-head attention (section 3.2.2):
each head has its own ``W_Q^i, W_K^i, W_V^i``; the heads' outputs are concatenated and
multiplied by ``W_O``. The by-hand numbers are compared with :func:`qkv.scaled_dot_product_attention`
and :class:`qkv.MultiHeadAttention` holding the same weights.

Shape legend: ``n`` tokens, ``d`` features (d_model), ``d_k`` key/query/value size of the single
head, ``h`` heads, ``d_h = d / h`` the size of each head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.attention.functional import scaled_dot_product_attention
from qkv.attention.multihead import MultiHeadAttention

MAX_TOKENS = 32
MAX_DIM = 64


@dataclass
class Head:
    """One head of the multi-head part (rows convention)."""

    w_q: Tensor  # (d, d_h)
    w_k: Tensor  # (d, d_h)
    w_v: Tensor  # (d, d_h)
    q: Tensor  # (n, d_h)
    k: Tensor  # (n, d_h)
    v: Tensor  # (n, d_h)
    weights: Tensor  # (n, n)
    z: Tensor  # (n, d_h)


@dataclass
class WorkedExample:
    """Every intermediate of the worked example, in float64."""

    x: Tensor  # (n, d) one token per row
    w_q: Tensor  # (d, d_k)
    w_k: Tensor  # (d, d_k)
    w_v: Tensor  # (d, d_k)
    q: Tensor  # (n, d_k) = X W_Q
    k: Tensor  # (n, d_k)
    v: Tensor  # (n, d_k)
    scores: Tensor  # (n, n) = Q K^T
    scaled: Tensor  # (n, n) = Q K^T / sqrt(d_k)
    weights: Tensor  # (n, n) softmax over each row
    z: Tensor  # (n, d_k) = A V
    q_cols: Tensor  # (d_k, n) = W_Q^T X^T (columns convention)
    k_cols: Tensor  # (d_k, n)
    v_cols: Tensor  # (d_k, n)
    scores_cols: Tensor  # (n, n) = K^T Q: row j = key j, column i = query i
    weights_cols: Tensor  # (n, n) softmax over each column
    z_cols: Tensor  # (d_k, n) = V A
    heads: list[Head]
    concat: Tensor  # (n, h * d_h)
    w_o: Tensor  # (h * d_h, d)
    multi_head: Tensor  # (n, d) = concat W_O
    library_z: Tensor  # (n, d_k) qkv.scaled_dot_product_attention (fast path)
    library_weights: Tensor  # (n, n) qkv.scaled_dot_product_attention(need_weights=True)
    library_multi_head: Tensor  # (n, d) qkv.MultiHeadAttention
    library_head_weights: Tensor  # (h, n, n)
    seed: int = 0
    checks: dict[str, float] = field(default_factory=dict)  # name -> max |difference|


def _softmax(scores: Tensor, dim: int) -> Tensor:
    """exp(s - max) / sum exp(s - max), written out."""
    shifted = scores - scores.max(dim=dim, keepdim=True).values
    e = torch.exp(shifted)
    return e / e.sum(dim=dim, keepdim=True)


def _random(shape: tuple[int, ...], generator: torch.Generator, std: float, decimals: int) -> Tensor:
    """Normal numbers rounded to ``decimals`` so that the printed values are the exact values."""
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * std).round(decimals=decimals)


def check_sizes(tokens: int, dim: int, dk: int, heads: int) -> None:
    """Raise ``ValueError`` unless every size is positive and within the explainer's limits."""
    for name, value in (("tokens", tokens), ("dim", dim), ("dk", dk), ("heads", heads)):
        if value < 1:
            raise ValueError(f"--{name} must be positive, got {value}")
    if tokens > MAX_TOKENS or dim > MAX_DIM or dk > MAX_DIM:
        raise ValueError(
            f"the worked example prints every number; keep --tokens <= {MAX_TOKENS} and --dim, --dk <= {MAX_DIM} "
            f"(got tokens={tokens}, dim={dim}, dk={dk})"
        )
    if dim % heads:
        raise ValueError(f"--dim ({dim}) must be divisible by --heads ({heads}): each head gets dim / heads features")


def worked_example(*, tokens: int = 4, dim: int = 6, dk: int = 3, heads: int = 2, seed: int = 0) -> WorkedExample:
    """Compute the worked example and compare it with the library.

    Args:
        tokens: ``n``, the number of tokens.
        dim: ``d``, features per token.
        dk: ``d_k`` of the single-head part.
        heads: ``h`` for the multi-head part (each head has ``d / h`` features).
        seed: seed of the random (rounded) inputs and weights.

    Returns:
        :class:`WorkedExample`; ``checks`` holds the largest absolute differences between the two
        conventions and between the by-hand numbers and the library.
    """
    check_sizes(tokens, dim, dk, heads)
    g = torch.Generator().manual_seed(seed)
    x = _random((tokens, dim), g, 1.0, 1)  # (n, d)
    w_q, w_k, w_v = (_random((dim, dk), g, 1.0 / math.sqrt(dim), 2) for _ in range(3))  # (d, d_k) each

    # rows: the paper's convention
    q, k, v = x @ w_q, x @ w_k, x @ w_v  # (n, d_k) each
    scores = q @ k.T  # (n, n): scores[i, j] = q_i . k_j
    scaled = scores / math.sqrt(dk)
    weights = _softmax(scaled, dim=1)  # each row sums to 1
    z = weights @ v  # (n, d_k)

    # columns: tokens are columns of X^T; the column convention's W_Q is our W_Q^T
    x_cols = x.T  # (d, n)
    q_cols, k_cols, v_cols = w_q.T @ x_cols, w_k.T @ x_cols, w_v.T @ x_cols  # (d_k, n) each
    scores_cols = k_cols.T @ q_cols  # (n, n): [j, i] = k_j . q_i
    weights_cols = _softmax(scores_cols / math.sqrt(dk), dim=0)  # each column sums to 1
    z_cols = v_cols @ weights_cols  # (d_k, n)

    head_list = _heads(x, g, heads)
    concat = torch.cat([head.z for head in head_list], dim=1)  # (n, h * d_h)
    w_o = _random((concat.size(1), dim), g, 1.0 / math.sqrt(dim), 2)  # (h * d_h, d)
    multi_head = concat @ w_o  # (n, d)

    # the library, on the same numbers
    library_z = scaled_dot_product_attention(q[None], k[None], v[None])[0]  # fast path, (n, d_k)
    _, library_weights = scaled_dot_product_attention(q[None], k[None], v[None], need_weights=True)
    library_multi_head, library_head_weights = _library_multi_head(x, head_list, w_o)
    example = WorkedExample(
        x=x,
        w_q=w_q,
        w_k=w_k,
        w_v=w_v,
        q=q,
        k=k,
        v=v,
        scores=scores,
        scaled=scaled,
        weights=weights,
        z=z,
        q_cols=q_cols,
        k_cols=k_cols,
        v_cols=v_cols,
        scores_cols=scores_cols,
        weights_cols=weights_cols,
        z_cols=z_cols,
        heads=head_list,
        concat=concat,
        w_o=w_o,
        multi_head=multi_head,
        library_z=library_z,
        library_weights=library_weights[0],
        library_multi_head=library_multi_head,
        library_head_weights=library_head_weights,
        seed=seed,
    )
    example.checks = _checks(example)
    return example


def _checks(e: WorkedExample) -> dict[str, float]:
    """The largest absolute differences between the two conventions, and between the by-hand
    numbers and the library's."""
    return {
        "columns vs rows: weights (A_cols vs A^T)": _diff(e.weights_cols, e.weights.T),
        "columns vs rows: output (Z_cols vs Z^T)": _diff(e.z_cols, e.z.T),
        "qkv.scaled_dot_product_attention: output": _diff(e.library_z, e.z),
        "qkv.scaled_dot_product_attention: weights": _diff(e.library_weights, e.weights),
        "qkv.MultiHeadAttention: output": _diff(e.library_multi_head, e.multi_head),
        "qkv.MultiHeadAttention: per-head weights": _diff(
            e.library_head_weights, torch.stack([head.weights for head in e.heads])
        ),
    }


def _heads(x: Tensor, g: torch.Generator, heads: int) -> list[Head]:
    """Multi-head attention by hand: per head, random rounded ``W_Q, W_K, W_V (d, d / heads)`` and
    its attention on ``x (n, d)``."""
    dim = x.size(1)
    d_h = dim // heads
    head_list = []
    for _ in range(heads):
        hq, hk, hv = (_random((dim, d_h), g, 1.0 / math.sqrt(dim), 2) for _ in range(3))  # (d, d_h)
        qi, ki, vi = x @ hq, x @ hk, x @ hv  # (n, d_h)
        ai = _softmax(qi @ ki.T / math.sqrt(d_h), dim=1)  # (n, n)
        head_list.append(Head(hq, hk, hv, qi, ki, vi, ai, ai @ vi))
    return head_list


def _library_multi_head(x: Tensor, head_list: list[Head], w_o: Tensor) -> tuple[Tensor, Tensor]:
    """qkv's :class:`MultiHeadAttention` with the by-hand heads' weights, on ``x (n, d)``: its
    output ``(n, d)`` and per-head weights ``(h, n, n)``."""
    mha = MultiHeadAttention(x.size(1), len(head_list), bias=False).double()
    with torch.no_grad():  # nn.Linear computes x W^T, so its weight is our matrix transposed
        mha.q_proj.weight.copy_(torch.cat([head.w_q for head in head_list], dim=1).T)
        mha.k_proj.weight.copy_(torch.cat([head.w_k for head in head_list], dim=1).T)
        mha.v_proj.weight.copy_(torch.cat([head.w_v for head in head_list], dim=1).T)
        mha.out_proj.weight.copy_(w_o.T)
        result = mha(x[None], need_weights=True)
    assert result.weights is not None  # need_weights
    return result.output[0], result.weights[0]


def _diff(a: Tensor, b: Tensor) -> float:
    return (a - b).abs().max().item()


class _Writer:
    """Formats headings, prose and matrices as plain text or markdown."""

    def __init__(self, fmt: str, decimals: int) -> None:
        if fmt not in ("text", "markdown"):
            raise ValueError(f"format must be 'text' or 'markdown', got {fmt!r}")
        self.fmt = fmt
        self.decimals = decimals
        self.lines: list[str] = []

    def heading(self, text: str) -> None:
        self.lines += ["", f"## {text}" if self.fmt == "markdown" else f"== {text} ==", ""]

    def say(self, text: str) -> None:
        self.lines += [text, ""] if self.fmt == "markdown" else [text]

    def matrix(self, name: str, m: Tensor, rows: list[str] | None = None, cols: list[str] | None = None) -> None:
        cells = [[f"{v:.{self.decimals}f}" for v in row] for row in m.tolist()]
        rows = rows or [str(i) for i in range(m.size(0))]
        cols = cols or [str(j) for j in range(m.size(1))]
        title = f"{name}  ({m.size(0)} x {m.size(1)})"
        if self.fmt == "markdown":
            self.lines += [f"**{title}**", "", "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            self.lines += [f"| **{r}** | " + " | ".join(row) + " |" for r, row in zip(rows, cells)]
            self.lines.append("")
        else:
            width = max(len(c) for row in cells for c in row + cols)
            label = max(len(r) for r in rows)
            self.lines.append(title)
            self.lines.append(" " * (label + 2) + " ".join(c.rjust(width) for c in cols))
            self.lines += [
                f"{r.rjust(label)} [" + " ".join(c.rjust(width) for c in row) + " ]" for r, row in zip(rows, cells)
            ]
            self.lines.append("")

    def text(self) -> str:
        return "\n".join(self.lines).strip() + "\n"


def format_example(example: WorkedExample, *, fmt: str = "text", decimals: int = 3) -> str:
    """The worked example as readable text (``fmt="text"``) or markdown, every step and number."""
    w = _Writer(fmt, decimals)
    n, d = example.x.shape
    d_k = example.w_q.size(1)
    w.heading(f"Scaled dot-product attention by hand: {n} tokens, {d} features, d_k = {d_k} (seed {example.seed})")
    w.say("Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V   (Attention Is All You Need, section 3.2.1)")
    _write_rows(w, example)
    _write_columns(w, example)
    _write_heads(w, example)
    w.heading("Checked against the library (float64)")
    for name, value in example.checks.items():
        w.say(f"{'- ' if fmt == 'markdown' else '  '}{name}: max |difference| = {value:.1e}")
    return w.text()


def _labels(example: WorkedExample) -> tuple[list[str], list[str], list[str]]:
    """Names of the tokens, the input features and the d_k features: ``t0.., f0.., k0..``."""
    n, d = example.x.shape
    return [f"t{i}" for i in range(n)], [f"f{j}" for j in range(d)], [f"k{j}" for j in range(example.w_q.size(1))]


def _write_rows(w: _Writer, example: WorkedExample) -> None:
    """Convention 1, the paper's: one token per row, step by step."""
    decimals, n = w.decimals, example.x.size(0)
    d_k = example.w_q.size(1)
    toks, feats, kdims = _labels(example)
    w.heading("Convention 1, rows (the paper, PyTorch): one token per row")
    w.say("Step 1. The input X: one row per token.")
    w.matrix("X", example.x, toks, feats)
    w.say("Step 2. Three learned projections, each d x d_k.")
    for name, m in (("W_Q", example.w_q), ("W_K", example.w_k), ("W_V", example.w_v)):
        w.matrix(name, m, feats, kdims)
    w.say("Step 3. Queries, keys and values: Q = X W_Q, K = X W_K, V = X W_V.")
    for name, m in (("Q", example.q), ("K", example.k), ("V", example.v)):
        w.matrix(name, m, toks, kdims)
    q0, k1 = example.q[0].tolist(), example.k[min(1, n - 1)].tolist()
    terms = " + ".join(f"({a:.{decimals}f})({b:.{decimals}f})" for a, b in zip(q0, k1))
    j = min(1, n - 1)
    w.say(
        f"Step 4. Scores S = Q K^T: S[i, j] = q_i . k_j, how well query i matches key j. "
        f"For example S[0, {j}] = {terms} = {example.scores[0, j].item():.{decimals}f}."
    )
    w.matrix("S = Q K^T   (rows: queries, columns: keys)", example.scores, toks, toks)
    w.say(
        f"Step 5. Divide by sqrt(d_k) = sqrt({d_k}) = {math.sqrt(d_k):.{decimals}f} so the scores keep "
        "unit variance as d_k grows (see `qkv experiment softmax-scaling`)."
    )
    w.matrix("S / sqrt(d_k)", example.scaled, toks, toks)
    row = example.scaled[0]
    exps = torch.exp(row - row.max())
    w.say(
        f"Step 6. Softmax over each row: a_ij = exp(s_ij) / sum_j' exp(s_ij'). Row 0: exp(s - max) = "
        f"[{', '.join(f'{v:.{decimals}f}' for v in exps.tolist())}], sum {exps.sum().item():.{decimals}f}; "
        "each row of A sums to 1."
    )
    w.matrix("A = softmax(S / sqrt(d_k))   (each row sums to 1)", example.weights, toks, toks)
    w.say("Step 7. The output: each token's new vector is the A-weighted average of the values, Z = A V.")
    w.matrix("Z = A V", example.z, toks, kdims)


def _write_columns(w: _Writer, example: WorkedExample) -> None:
    """Convention 2: one token per column, the same numbers transposed."""
    toks, _, kdims = _labels(example)
    code = "`" if w.fmt == "markdown" else ""
    w.heading("Convention 2, columns: one token per column")
    w.say(
        f"Here X is d x n (our X^T) and the projections are d_k x d (our W^T): {code}Q = W_Q X{code}, "
        f"{code}K = W_K X{code}, {code}V = W_V X{code}."
    )
    for name, m in (("Q (columns)", example.q_cols), ("K (columns)", example.k_cols), ("V (columns)", example.v_cols)):
        w.matrix(name, m, kdims, toks)
    w.say(
        "Scores K^T Q: entry [j, i] = k_j . q_i, so each column belongs to one query; the softmax runs "
        "down each column; the output is Z = V A with one token per column."
    )
    w.matrix("K^T Q   (rows: keys, columns: queries)", example.scores_cols, toks, toks)
    w.matrix("A = softmax over each column of K^T Q / sqrt(d_k)", example.weights_cols, toks, toks)
    w.matrix("Z = V A (columns)", example.z_cols, kdims, toks)
    w.say(
        f"Same numbers, transposed: max |A_cols - A_rows^T| = "
        f"{example.checks['columns vs rows: weights (A_cols vs A^T)']:.1e}, max |Z_cols - Z_rows^T| = "
        f"{example.checks['columns vs rows: output (Z_cols vs Z^T)']:.1e}."
    )


def _write_heads(w: _Writer, example: WorkedExample) -> None:
    """Multi-head attention: every head's projections and weights, the concatenation, W_O."""
    toks, feats, _ = _labels(example)
    h = len(example.heads)
    d_h = example.x.size(1) // h
    hdims = [f"k{j}" for j in range(d_h)]
    w.heading(f"Multi-head attention: {h} heads of d_h = d / h = {d_h}")
    w.say(
        "MultiHead(X) = Concat(head_1, ..., head_h) W_O, head_i = Attention(X W_Q^i, X W_K^i, X W_V^i) "
        "(section 3.2.2). Each head scales by sqrt(d_h)."
    )
    for i, head in enumerate(example.heads, start=1):
        w.say(f"Head {i}:")
        for name, m in ((f"W_Q^{i}", head.w_q), (f"W_K^{i}", head.w_k), (f"W_V^{i}", head.w_v)):
            w.matrix(name, m, feats, hdims)
        for name, m in ((f"Q^{i} = X W_Q^{i}", head.q), (f"K^{i} = X W_K^{i}", head.k), (f"V^{i} = X W_V^{i}", head.v)):
            w.matrix(name, m, toks, hdims)
        w.matrix(f"A^{i} = softmax(Q^{i} K^{i}^T / sqrt({d_h}))", head.weights, toks, toks)
        w.matrix(f"Z^{i} = A^{i} V^{i}", head.z, toks, hdims)
    concat_cols = [f"h{i}.k{j}" for i in range(1, h + 1) for j in range(d_h)]
    w.matrix("Concat(Z^1, ..., Z^h)", example.concat, toks, concat_cols)
    w.matrix("W_O", example.w_o, concat_cols, feats)
    w.matrix("MultiHead(X) = Concat W_O", example.multi_head, toks, feats)
