"""Long inputs: the reduced form of a view's weights, for when every weight would not fit in a page.

A view of ``L`` layers x ``H`` heads over ``s_q`` x ``s_k`` tokens has ``L H s_q s_k`` weights: 6 x 12 x
512 x 512 (a BERT at 512 tokens) is 18.9 million, which the page carries exactly (:mod:`qkv.viz.html`
packs them into a few MB); 4 x 8 x 4,096 x 4,096 (a language model at a 4,096-token context) is 537
million, 1 GB even as uint16. Up to :data:`FULL_WEIGHTS_LIMIT` weights an array stays exact, every
weight; above it the document holds its *reduced form* (:func:`reduce_weights`) instead, whose size
grows with ``s_q`` rather than ``s_q s_k``:

* ``index`` / ``weight``: for each row (query), its :data:`TOP_K` largest weights, exactly as the
  full array would have them (rounded to 4 decimals, like every weight of the document), largest
  first, equal weights in key order, and the key index of each;
* ``blocks``: an overview, the rows and keys cut into blocks of ``block`` = ``[b_q, b_k]`` tokens
  (at most :data:`OVERVIEW_CELLS` blocks a side; the last block of a side may be shorter) and the
  mean weight of each block: the sum of its weights over its number of (query, key) cells, a
  causal mask's zeros included. Rounded to 8 decimals.

JSON layout (``reduced: "qkv-reduced/1"``), for an array of full shape ``(*lead, s_q, s_k)``
(a view's ``attention`` has ``lead = (L, H)``, its ``rollout`` ``lead = (L,)``)::

    {"reduced": "qkv-reduced/1", "shape": [*lead, s_q, s_k], "k": K, "block": [b_q, b_k],
     "index": [*lead][s_q][K] ints, "weight": [*lead][s_q][K] floats,
     "blocks": [*lead][ceil(s_q / b_q)][ceil(s_k / b_k)] floats}

What the page draws from it is said on the page: a line for each of a query's K largest weights (of
0.01 or more), the model view's heatmaps and the head view's overview from the block means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

REDUCED = "qkv-reduced/1"
FULL_WEIGHTS_LIMIT = 1 << 25  # weights an array may have and stay exact (33.5 million: 32 heads at 1,024 tokens)
TOP_K = 8  # the largest weights kept of each row
OVERVIEW_CELLS = 128  # the block overview has at most this many blocks a side
DECIMALS = 4  # the document's weights (qkv.viz.export.AttentionView.to_dict, qkv.viz.analysis.rounded)
BLOCK_DECIMALS = 8
ROW_CHUNK = 256  # rows of a matrix reduced at a time (about 8 MB as float64 at 4,096 keys)


def too_large(shape: Sequence[int], limit: int | None = None) -> bool:
    """Whether an array of ``shape`` has more weights than ``limit`` (default
    :data:`FULL_WEIGHTS_LIMIT`, read when called), the most the page keeps exactly."""
    return math.prod(int(n) for n in shape) > (FULL_WEIGHTS_LIMIT if limit is None else limit)


def block_size(n: int, cells: int = OVERVIEW_CELLS) -> int:
    """Tokens per block for ``n`` tokens cut into at most ``cells`` blocks."""
    return max(1, math.ceil(n / cells))


def _top_k(units: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest of each row of integer weights ``(s_q, s_k)`` (float64 holding integers),
    largest first, ties in key order: ``(index (s_q, k) long, units (s_q, k))``."""
    s_k = units.size(-1)
    wide = 10**DECIMALS * s_k >= 2**31  # int32 keys up to 214,748 keys
    dtype = torch.int64 if wide else torch.int32
    order = torch.arange(s_k - 1, -1, -1, dtype=dtype)  # a later key loses a tie
    index = (units.to(dtype) * s_k + order).topk(k, dim=-1).indices  # unique keys: no tie is left to topk
    return index, units.gather(-1, index)


def _block_means(weights: Tensor, b_q: int, b_k: int) -> Tensor:
    """Mean weight of each ``b_q`` x ``b_k`` block of ``(s_q, s_k)`` (shorter blocks at the ends)."""
    s_q, s_k = weights.shape
    nq, nk = math.ceil(s_q / b_q), math.ceil(s_k / b_k)
    padded = weights
    if (nq * b_q, nk * b_k) != (s_q, s_k):
        padded = torch.zeros(nq * b_q, nk * b_k, dtype=torch.float64)
        padded[:s_q, :s_k] = weights
    sums = padded.reshape(nq, b_q, nk, b_k).sum((1, 3))
    rows = torch.full((nq,), float(b_q), dtype=torch.float64)
    rows[-1] = s_q - (nq - 1) * b_q
    cols = torch.full((nk,), float(b_k), dtype=torch.float64)
    cols[-1] = s_k - (nk - 1) * b_k
    return sums / (rows[:, None] * cols[None, :])


def reduce_weights(array: Tensor | Sequence[Tensor], *, k: int = TOP_K, cells: int = OVERVIEW_CELLS) -> dict[str, Any]:
    """The reduced form of weights ``(*lead, s_q, s_k)`` (see the module docstring).

    Args:
        array: one tensor, or a list of per-layer tensors of equal shape (stacked as the first axis).
        k: the largest weights kept per row (at most ``s_k``).
        cells: the most blocks a side of the overview.

    Returns:
        The JSON-ready ``{"reduced": "qkv-reduced/1", ...}`` dict.
    """
    parts = [array] if isinstance(array, Tensor) else list(array)  # not stacked: a 4,096-token layer is GBs
    if not parts or any(p.shape != parts[0].shape for p in parts):
        raise ValueError("weights: no layers, or layers of different shapes")
    shape = tuple(parts[0].shape) if isinstance(array, Tensor) else (len(parts), *parts[0].shape)
    if len(shape) < 2 or 0 in shape:
        raise ValueError(f"weights must be (..., s_q, s_k) with no empty axis, got shape {shape}")
    s_q, s_k = shape[-2:]
    k = min(k, s_k)
    b_q, b_k = block_size(s_q, cells), block_size(s_k, cells)
    index, weight, blocks = [], [], []
    matrices = (m for part in parts for m in part.detach().reshape(-1, s_q, s_k))
    step = b_q * max(1, ROW_CHUNK // b_q)  # whole row blocks at a time, so each block is summed in one piece
    for matrix in matrices:  # one (s_q, s_k) at a time, in row chunks: a 4,096-token head is 134 MB as float64
        top_rows, unit_rows, block_rows = [], [], []
        for r0 in range(0, s_q, step):
            m = matrix[r0 : r0 + step].to(device="cpu", dtype=torch.float64)
            top, units = _top_k((m * 10**DECIMALS).round_(), k)
            top_rows.append(top)
            unit_rows.append(units)
            block_rows.append(_block_means(m, b_q, b_k))
        index.append(torch.cat(top_rows).numpy().astype(np.int32))
        weight.append(torch.cat(unit_rows).numpy() / 10**DECIMALS)
        blocks.append(torch.cat(block_rows).numpy())  # chunks of whole row blocks: their means are the matrix's
    lead = shape[:-2]
    nq, nk = blocks[0].shape
    return {
        "reduced": REDUCED,
        "shape": list(shape),
        "k": k,
        "block": [b_q, b_k],
        "index": np.stack(index).reshape(*lead, s_q, k).tolist(),
        "weight": np.round(np.stack(weight), DECIMALS).reshape(*lead, s_q, k).tolist(),
        "blocks": np.round(np.stack(blocks), BLOCK_DECIMALS).reshape(*lead, nq, nk).tolist(),
    }


def weights_field(array: Tensor | Sequence[Tensor], limit: int | None = None) -> list | dict[str, Any]:
    """A document's weights (one tensor, or one per layer): nested lists rounded to 4 decimals, or,
    for more than ``limit`` weights, the reduced form (:func:`reduce_weights`)."""
    parts = [array] if isinstance(array, Tensor) else list(array)
    shape = tuple(parts[0].shape) if isinstance(array, Tensor) else (len(parts), *parts[0].shape)
    if too_large(shape, limit):
        return reduce_weights(array)
    rounded = [p.detach().to(device="cpu", dtype=torch.float64).round(decimals=DECIMALS).tolist() for p in parts]
    return rounded[0] if isinstance(array, Tensor) else rounded


def is_reduced(value: object) -> bool:
    """Whether a document's ``attention`` or ``rollout`` is in the reduced form."""
    return isinstance(value, dict) and value.get("reduced") == REDUCED


def _shape_of(grid: object, depth: int) -> list[int]:
    """The lengths along the first ``depth`` axes of nested lists (first element of each)."""
    out = []
    for _ in range(depth):
        if not isinstance(grid, list):
            break
        out.append(len(grid))
        grid = grid[0] if grid else None
    return out


def check_reduced(value: object, shape: Sequence[int], where: str) -> None:
    """``ValueError`` (one line, naming ``where``) unless ``value`` is a reduced form of full shape ``shape``."""
    if not is_reduced(value):
        raise ValueError(f"{where} must be nested lists or a {REDUCED} object")
    assert isinstance(value, dict)
    shape = [int(n) for n in shape]
    if value.get("shape") != shape:
        raise ValueError(f"{where}: reduced weights of shape {value.get('shape')}, expected {shape}")
    k, block = value.get("k"), value.get("block")
    s_q, s_k = shape[-2:]
    if not isinstance(k, int) or not 1 <= k <= s_k:
        raise ValueError(f"{where}: 'k' must be an integer from 1 to {s_k}")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise ValueError(f"{where}: 'block' must be [b_q, b_k], two positive integers")
    lead = shape[:-2]
    expected = {
        "index": [*lead, s_q, k],
        "weight": [*lead, s_q, k],
        "blocks": [*lead, math.ceil(s_q / block[0]), math.ceil(s_k / block[1])],
    }
    for key, want in expected.items():
        try:
            values = np.asarray(value.get(key), dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {key!r} must be {' x '.join(map(str, want))} nested lists of numbers") from None
        if list(values.shape) != want or not np.isfinite(values).all():
            got = _shape_of(value.get(key), len(want))
            raise ValueError(f"{where}: {key!r} must be {' x '.join(map(str, want))} numbers, got {got}")
        if key == "index" and not (
            np.array_equal(values, np.rint(values)) and values.min() >= 0 and values.max() < s_k
        ):
            raise ValueError(f"{where}: 'index' must hold key positions below {s_k}")
        if key != "index" and values.min() < 0:
            raise ValueError(f"{where}: {key!r} must not be negative")
