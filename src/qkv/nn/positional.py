"""Positional encodings: the paper's fixed sinusoids (section 3.5) and a learned table.

Both take ``x`` of shape ``(b, s, d)`` and return ``x`` plus the encoding of positions
``start .. start + s - 1`` (``start`` > 0 when decoding step by step with a cache).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor, nn


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    Returns:
        float32 tensor ``(max_len, d_model)``.
    """
    if d_model % 2 != 0:
        raise ValueError(f"the sinusoidal encoding needs an even d_model, got {d_model}")
    if torch.empty(0).is_meta:  # built on the meta device (shapes only): no values to compute, and PyTorch
        return torch.empty(max_len, d_model)  # computes these operators there through its compiler's references
    position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)  # even dims: sin
    table[:, 1::2] = torch.cos(position * inv_freq)  # odd dims: cos
    return table.float()


class _PositionalEncoding(nn.Module):
    max_len: int

    def _positions(self, x: Tensor, start: int | Tensor) -> Tensor | None:
        """Checks ``x`` and the positions; ``(b, s)`` positions for a per-row ``start (b,)``, else None."""
        if x.dim() != 3:
            raise ValueError(f"positional encoding expects (batch, seq, d_model), got {tuple(x.shape)}")
        first, last = (int(start.min()), int(start.max())) if isinstance(start, Tensor) else (start, start)
        if first < 0 or last + x.size(1) > self.max_len:
            raise ValueError(
                f"positions {first}..{last + x.size(1) - 1} exceed the positional table of "
                f"max_len={self.max_len}; raise max_len in the config"
            )
        if isinstance(start, Tensor):  # each row from its own position (a batch of joined members)
            return start[:, None] + torch.arange(x.size(1), device=x.device)
        return None


class SinusoidalPositionalEncoding(_PositionalEncoding):
    """Fixed sinusoidal encoding, added to the input (not a parameter; saved with the model)."""

    table: Tensor  # (max_len, d) the buffer

    def __init__(self, d_model: int, max_len: int = 1024) -> None:
        super().__init__()
        self.max_len = max_len
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, x: Tensor, start: int | Tensor = 0) -> Tensor:
        """Add the encoding of positions ``start .. start + s - 1`` to ``x``.

        Args:
            x: ``(b, s, d)`` the embedded tokens.
            start: the first position (the tokens already decoded, with a cache), or ``(b,)``
                each row's own.

        Returns:
            ``x``'s shape and dtype.

        Raises:
            ValueError: ``x`` is not 3-D, or the positions run past ``max_len``.
        """
        rows = self._positions(x, start)
        if rows is not None:
            return x + self.table[rows].to(x.dtype)
        return x + self.table[start : start + x.size(1)].to(x.dtype)  # (b, s, d)


class LearnedPositionalEncoding(_PositionalEncoding):
    """A trained embedding per position (as in BERT), added to the input."""

    def __init__(self, d_model: int, max_len: int = 1024) -> None:
        super().__init__()
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, x: Tensor, start: int | Tensor = 0) -> Tensor:
        """Add the encoding of positions ``start .. start + s - 1`` to ``x``.

        Args:
            x: ``(b, s, d)`` the embedded tokens.
            start: the first position (the tokens already decoded, with a cache), or ``(b,)``
                each row's own.

        Returns:
            ``x``'s shape and dtype.

        Raises:
            ValueError: ``x`` is not 3-D, or the positions run past ``max_len``.
        """
        rows = self._positions(x, start)
        if rows is None:  # an int (a symbolic one in an ONNX export: never int() it, which would fix it)
            first = cast(int, start)
            rows = torch.arange(first, first + x.size(1), device=x.device)
        return x + self.embedding(rows).to(x.dtype)  # (b, s, d)


POSITIONAL_KINDS = ("sinusoidal", "learned", "none")


def build_positional_encoding(kind: str, d_model: int, max_len: int) -> nn.Module:
    """``kind`` is ``"sinusoidal"``, ``"learned"`` or ``"none"`` (identity)."""
    if kind == "sinusoidal":
        return SinusoidalPositionalEncoding(d_model, max_len)
    if kind == "learned":
        return LearnedPositionalEncoding(d_model, max_len)
    if kind == "none":
        return NoPositionalEncoding()
    raise ValueError(f"unknown positional encoding {kind!r}; choose sinusoidal, learned or none")


class NoPositionalEncoding(nn.Module):
    """Identity: the model sees a bag of tokens (used to show permutation equivariance)."""

    def forward(self, x: Tensor, start: int | Tensor = 0) -> Tensor:
        """``x`` unchanged.

        Args:
            x: ``(b, s, d)`` the embedded tokens.
            start: ignored; taken for the interface the other encodings share.

        Returns:
            ``x`` itself.
        """
        return x
