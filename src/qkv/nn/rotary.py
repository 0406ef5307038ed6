"""Rotary position embedding (Su et al. 2021, "RoFormer"), with linear and Llama-3 frequency scaling.

Each head's first ``r`` dims (``r = int(head_dim * fraction)``) are rotated: dim ``i < r/2`` pairs with
dim ``i + r/2`` (the "rotate half" layout of Llama and GPT-NeoX), and the pair at position ``p`` turns
by the angle ``p * theta_i`` with ``theta_i = base^(-2i/r)``. The dot product of a query at ``p`` and a
key at ``p'`` then depends on the positions only through ``p - p'``. The dims after ``r`` (a partial
rotary, as Phi and GPT-NeoX) pass through unchanged.

Scaling stretches the frequencies for contexts longer than the training one: ``linear`` divides every
``theta_i`` by ``scaling_factor`` (position interpolation, Chen et al. 2023); ``llama3`` divides only
the low frequencies (wavelengths longer than ``original_context / low_freq_factor``), keeps the high
ones (wavelengths shorter than ``original_context / high_freq_factor``) and blends between the two.

Shape legend: ``b`` batch, ``h`` heads, ``s`` positions, ``d_h`` head_dim, ``r`` rotated dims.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

ROTARY_SCALINGS = ("none", "linear", "llama3")


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by their absolute positions (see the module's docstring).

    The inverse frequencies ``theta_i`` are a buffer not saved with the model (they follow from the
    options), kept in float32 when the model is cast to another dtype.
    """

    inv_freq: Tensor  # (r/2,) float32

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        fraction: float = 1.0,
        scaling: str = "none",
        scaling_factor: float = 1.0,
        low_freq_factor: float = 1.0,
        high_freq_factor: float = 4.0,
        original_context: int = 8192,
    ) -> None:
        """Args:
        head_dim: the width of one head.
        base: ``theta``, the base of the frequencies.
        fraction: the share of each head's dims rotated (the first ones), in (0, 1].
        scaling: ``"none"``, ``"linear"`` or ``"llama3"`` (see the module's docstring).
        scaling_factor: what ``linear`` and ``llama3`` divide the (low) frequencies by.
        low_freq_factor, high_freq_factor: ``llama3``: the wavelength bounds, as fractions of the context.
        original_context: ``llama3``: the context length the model was trained with.
        """
        super().__init__()
        if head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {head_dim}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        rotated = int(head_dim * fraction)
        if rotated < 2 or rotated % 2 != 0:
            raise ValueError(f"fraction: the rotated dims (int(head_dim * fraction) = {rotated}) must be even and > 0")
        if base <= 0:
            raise ValueError(f"base must be positive, got {base}")
        if scaling not in ROTARY_SCALINGS:
            raise ValueError(f"unknown scaling {scaling!r}; choose one of {list(ROTARY_SCALINGS)}")
        if scaling_factor <= 0:
            raise ValueError(f"scaling_factor must be positive, got {scaling_factor}")
        if scaling == "llama3" and not 0 < low_freq_factor < high_freq_factor:
            raise ValueError(
                f"high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor}) > 0"
            )
        if scaling == "llama3" and original_context < 1:
            raise ValueError(f"original_context must be positive, got {original_context}")
        self.head_dim, self.rotated, self.base, self.fraction = head_dim, rotated, base, fraction
        self.scaling, self.scaling_factor = scaling, scaling_factor
        self.low_freq_factor, self.high_freq_factor = low_freq_factor, high_freq_factor
        self.original_context = original_context
        self.register_buffer("inv_freq", self.inverse_frequencies(), persistent=False)

    def inverse_frequencies(self) -> Tensor:
        """The frequencies ``theta_i`` after scaling, computed on the CPU.

        Returns:
            ``(r/2,)`` float32.
        """
        half = self.rotated // 2
        if torch.empty(0).is_meta:  # built on the meta device (shapes only): no values to compute
            return torch.empty(half)
        exponents = torch.arange(0, self.rotated, 2, dtype=torch.int64, device="cpu").float() / self.rotated
        inv_freq = 1.0 / (self.base**exponents)  # (r/2,) theta_i = base^(-2i/r)
        if self.scaling == "linear":
            return inv_freq / self.scaling_factor
        if self.scaling == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: Tensor) -> Tensor:
        wavelength = 2 * math.pi / inv_freq  # (r/2,)
        long_bound = self.original_context / self.low_freq_factor  # longer wavelengths: divided by the factor
        short_bound = self.original_context / self.high_freq_factor  # shorter wavelengths: kept
        low = inv_freq / self.scaling_factor
        # in between, from divided (the wavelength at long_bound) to kept (at short_bound), linear in 1 / wavelength
        blend = (self.original_context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        middle = (1 - blend) * inv_freq / self.scaling_factor + blend * inv_freq
        scaled = torch.where(wavelength > long_bound, low, inv_freq)
        return torch.where((wavelength >= short_bound) & (wavelength <= long_bound), middle, scaled)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RotaryEmbedding:
        # .to(dtype) / .half() would round the frequencies (and so every angle, worst at far positions),
        # and to_empty() would leave them unset: they are recomputed in float32 on the buffer's new device
        super()._apply(fn, recurse)
        if not self.inv_freq.is_meta:
            self.inv_freq = self.inverse_frequencies().to(self.inv_freq.device)
        return self

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The cosines and sines of every rotated dim's angle at ``positions``.

        Args:
            positions: ``(s,)`` or ``(b, s)`` integer positions.

        Returns:
            ``(cos, sin)``, float32, each ``(s, r)`` for ``(s,)`` positions or ``(b, 1, s, r)`` for
            ``(b, s)`` ones (broadcasting over the heads of a ``(b, h, s, d_h)`` tensor).
        """
        if positions.dim() not in (1, 2):
            raise ValueError(f"positions must be (s,) or (b, s), got shape {tuple(positions.shape)}")
        angles = positions[..., None].float() * self.inv_freq.to(positions.device)  # (..., s, r/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., s, r): dims i and i + r/2 share an angle
        if positions.dim() == 2:
            angles = angles[:, None]  # (b, 1, s, r)
        return angles.cos(), angles.sin()

    def rotate_by(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate ``x`` by the angles of :meth:`cos_sin` (computed once for queries and keys alike).

        Args:
            x: ``(b, h, s, d_h)``.
            cos, sin: from :meth:`cos_sin`.

        Returns:
            ``x``'s shape and dtype: the first ``r`` dims rotated in float32 (float64 for a float64 ``x``),
            the rest as they were.
        """
        if x.size(-1) != self.head_dim:
            raise ValueError(f"x's last dim must be head_dim={self.head_dim}, got {x.size(-1)}")
        compute = torch.promote_types(x.dtype, torch.float32)  # half precision rotates in float32
        rotated, rest = x[..., : self.rotated].to(compute), x[..., self.rotated :]
        first, second = rotated.chunk(2, dim=-1)  # (b, h, s, r/2) each
        turned = torch.cat((-second, first), dim=-1)  # (b, h, s, r): the pair (a, b) -> (-b, a)
        out = (rotated * cos + turned * sin).to(x.dtype)  # (a, b) -> (a cos - b sin, b cos + a sin)
        return out if rest.size(-1) == 0 else torch.cat((out, rest), dim=-1)  # (b, h, s, d_h)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate one tensor of heads by its positions.

        Args:
            x: ``(b, h, s, d_h)`` queries or keys.
            positions: ``(s,)`` or ``(b, s)`` integer positions (absolute: a cache's length onwards when
                decoding step by step).

        Returns:
            ``x``'s shape and dtype.
        """
        cos, sin = self.cos_sin(positions)
        return self.rotate_by(x, cos, sin)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate queries and keys at the same positions.

        Args:
            q: ``(b, h, s, d_h)`` queries.
            k: ``(b, h_kv, s, d_h)`` keys (``h_kv`` may differ from ``h``: grouped-query attention).
            positions: ``(s,)`` or ``(b, s)`` integer positions.

        Returns:
            ``(q, k)`` rotated, their shapes and dtypes.
        """
        cos, sin = self.cos_sin(positions)
        return self.rotate_by(q, cos, sin), self.rotate_by(k, cos, sin)

    def extra_repr(self) -> str:
        """The options, for ``print(model)``."""
        scaling = "" if self.scaling == "none" else f", scaling={self.scaling}, factor={self.scaling_factor}"
        return f"head_dim={self.head_dim}, rotated={self.rotated}, base={self.base}{scaling}"
