"""The position-wise feed-forward network (section 3.3) and its activations, gated ones included.

Plain: ``FFN(x) = act(x W_1 + b_1) W_2 + b_2``. Gated (GLU variants, Shazeer 2020, "GLU Variants Improve
Transformer"): ``FFN(x) = (act(x W_gate + b_gate) * (x W_1 + b_1)) W_2 + b_2``, with SiLU (SwiGLU, as
Llama) or the exact erf GELU (GeGLU). ``W_1`` is the "up" product, ``W_gate`` the gate's, ``W_2`` the
"down" product; in a gated network ``d_ff`` is the width of the gate and of the up product alike.

Shape legend: ``d`` d_model, ``f`` d_ff.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.dropout import Dropout
from qkv.runtime.padded_linear import Linear

Sublayer = Callable[[Tensor], Tensor]  # (..., d) -> (..., d), as qkv.nn.layers.Sublayer
Gating = Callable[[Tensor, Tensor], Tensor]  # (gate product, up product) -> the hidden layer, each (..., f)


def relu_squared(x: Tensor) -> Tensor:
    """``relu(x)^2`` (So et al. 2021, "Primer").

    Args:
        x: any shape.

    Returns:
        ``x``'s shape.
    """
    return F.relu(x).square()


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# The nonlinearity of each activation name. For a gated name (GATED) it is the nonlinearity applied to
# the gate's product, which then multiplies the up product (FeedForward.gating).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "relu2": relu_squared,
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,  # the exact erf form
}
GATED = ("swiglu", "geglu")  # the activations whose network has a third product, the gate


class FeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2 (section 3.3), or its gated form (see the module's docstring),
    with dropout after the activation (after the gate's product, when gated)."""

    def __init__(self, d_model: int, d_ff: int, *, dropout: float = 0.0, activation: str = "relu", bias: bool = True):
        """Args:
        d_model: model width. d_ff: inner width (of the gate and the up product alike, when gated).
        dropout: on the hidden layer. activation: a name of :data:`ACTIVATIONS`; one of :data:`GATED`
        adds the gate's product ``gate``. bias: biases on every product.
        """
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        self.linear1 = Linear(d_model, d_ff, bias=bias)  # W_1, the up product
        self.gate = Linear(d_model, d_ff, bias=bias) if activation in GATED else None  # W_gate
        self.linear2 = Linear(d_ff, d_model, bias=bias)  # W_2, the down product
        self.dropout = Dropout(dropout)
        self.activation = activation

    @property
    def gated(self) -> bool:
        """Whether the network has the gate's product (its activation is one of :data:`GATED`)."""
        return self.gate is not None

    def forward(self, x: Tensor) -> Tensor:
        """The network over ``x``, each position on its own.

        Args:
            x: ``(..., d)`` hidden states.

        Returns:
            ``x``'s shape.
        """
        return self.compute(x, self._first, self.linear2, self.dropout)  # (b, s, d)

    def _first(self, x: Tensor) -> Tensor:
        if self.gate is None:
            return ACTIVATIONS[self.activation](self.linear1(x))  # act(x W_1 + b_1)
        return self.gating(self.activation)(self.gate(x), self.linear1(x))  # act(x W_gate + b_gate) * (x W_1 + b_1)

    @staticmethod
    def gating(activation: str) -> Gating:
        """The hidden layer of a gated network from its two products: ``act(gate) * up``.

        Args:
            activation: one of :data:`GATED`.

        Returns:
            ``(gate, up) -> act(gate) * up``, with ``gate = x W_gate + b_gate`` and ``up = x W_1 + b_1``,
            both ``(..., f)``; the result is ``(..., f)``.
        """
        if activation not in GATED:
            raise ValueError(f"activation {activation!r} is not gated; the gated ones are {list(GATED)}")
        act = ACTIVATIONS[activation]

        def hidden(gate: Tensor, up: Tensor) -> Tensor:
            return act(gate) * up  # (..., f)

        return hidden

    @staticmethod
    def compute(x: Tensor, first: Sublayer, second: Sublayer, dropout: Sublayer | None = None) -> Tensor:
        """The network over given products: ``second(dropout(first(x)))``.

        Args:
            x: ``(..., d)``.
            first: ``act(x W_1 + b_1)``, the activation included (an inference product may compute it in
                the product's own pass); for a gated network, the gated hidden layer
                (:meth:`gating` over the gate's and the up products).
            second: ``h W_2 + b_2``.
            dropout: after the activation; None: none.

        Returns:
            ``(..., d)``.
        """
        h = first(x)
        return second(h if dropout is None else dropout(h))
