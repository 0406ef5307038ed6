"""Linear layers whose matrix products come in few shapes, where each new shape costs a compilation.

On CPUs with AVX512-BF16 or AMX, PyTorch runs bfloat16 matrix products through oneDNN, which
compiles a kernel ("primitive") for every new shape: about 5 ms for a (3,700 x 256) x (256 x 1,024)
product that then takes 1 ms (2-core Xeon, torch 2.13). Token-count batches give the linear layers a
different number of rows (``b * s``) on almost every step, and a step has ~30 distinct products
forward and backward, so without help every step pays for ~30 compilations, or the primitive cache
grows without bound (qkv.runtime.heap caps it). Here the rows of a linear layer's input are padded with
zeros up to a multiple of :data:`ROW_MULTIPLE` before the product and the padding sliced off after:
rows are independent in ``x @ W.T + b``, so the real rows' results are the same products, the
gradient of the padding rows is dropped by the slice, and ``W``'s gradient gets zero from them. A
step then reuses a few dozen primitives for its whole run, at the cost of at most ``ROW_MULTIPLE -
1`` padded rows per product (~3% of a Multi30k batch).

Only bf16 products on CPU with at least :data:`ROW_MULTIPLE` rows are padded: float32 on CPU goes
to MKL, which compiles nothing, and small products (decoding a few sentences) would mostly be
padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROW_MULTIPLE = 256  # rows of a padded product are a multiple of this
PAD_ROWS = True  # False: never pad (to measure what padding buys, benchmarks/memory.py)


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of :data:`ROW_MULTIPLE`."""
    return -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def pads_rows(x: Tensor, rows: int) -> bool:
    """Whether a product with ``rows`` rows of ``x`` runs as a bf16 oneDNN product on CPU (autocast
    to bf16, or bf16 itself) and is big enough to pad."""
    # is_compiling first: a compiled graph never pads, and asking about ``rows`` (symbolic there) would
    # guard the graph on it, a recompile when a batch crosses ROW_MULTIPLE rows
    if torch.compiler.is_compiling() or not PAD_ROWS or x.device.type != "cpu" or rows < ROW_MULTIPLE:
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") == torch.bfloat16
    return x.dtype == torch.bfloat16


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """A 2-D ``x`` with zero rows appended up to ``rows`` rows."""
    return x if x.size(0) == rows else F.pad(x, (0, 0, 0, rows - x.size(0)))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, computed on rows padded to a multiple of :data:`ROW_MULTIPLE`
    where that spares oneDNN a compilation (see the module's docstring). ``x``: ``(..., in)``."""
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    if not pads_rows(x, rows):
        return F.linear(x, weight, bias)
    flat = pad_rows(x.reshape(rows, x.size(-1)), padded_rows(rows))
    return F.linear(flat, weight, bias)[:rows].view(*x.shape[:-1], weight.size(0))


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose product goes through :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        """``x @ weight.T + bias`` through the padded product."""
        return linear(x, self.weight, self.bias)
