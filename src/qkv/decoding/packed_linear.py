"""Linear products for CPU decoding in float32, with their weights packed once for oneDNN.

A decoding step multiplies a few rows (the sentences, times the beam) by every weight matrix, where
PyTorch's float32 ``F.linear`` (MKL) is slow on the CPUs qkv is measured on; oneDNN with the weight
reordered ("packed") into its blocked layout once, instead of on every call, is faster
(docs/history/decoding-fast-path.md has the figures). :class:`PackedLinear` packs a copy of the weight
it is built with and multiplies through oneDNN; it computes ``F.linear(x, weight, bias)`` up to float32
rounding (the sums are taken in another order), which tests/test_decoding_speedpath.py holds to 1e-5.

A :class:`PackedLinear` is a snapshot: it computes with the weight as it was when it was built, and
nothing outside it is kept or looked up. Its owner (:class:`qkv.decoding.inference.InferenceModel`)
builds new ones when the weights have changed.

Which weights are packed depends on the CPU's vector width (:data:`MIN_WEIGHT`): with AVX512 every
one (oneDNN computes with AVX512 there, while the MKL in PyTorch's wheels does not on AMD CPUs); with
AVX2 only the large ones (the vocabulary projection), where packing pays.

oneDNN's packed product is a private PyTorch operator (``torch.ops.mkldnn``): where it is missing,
refuses the weight, or disagrees with ``F.linear`` on a probe, :class:`PackedLinear` falls back to
``F.linear``.

Shape legend: ``n`` rows, ``i`` input features, ``o`` output features.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.layers import ACTIVATIONS

logger = logging.getLogger(__name__)


def _wide_vectors() -> bool:
    """Whether PyTorch's kernels run with AVX512 (or wider) on this CPU."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return capability.startswith("AVX512") or capability.startswith("AMX")


PACK = True  # False: every PackedLinear runs F.linear (to measure what packing buys)
# smaller weights (i * o elements) stay with F.linear: with AVX2 all but the vocabulary projection, with
# AVX512 none (see the module docstring)
MIN_WEIGHT = 0 if _wide_vectors() else 1 << 20
_PROBE_TOLERANCE = 1e-4  # relative to the largest output on the probe


def _pack(weight: Tensor) -> Tensor | None:
    """``weight (o, i)`` reordered for oneDNN's float32 product, or None where that is not available."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._reorder_linear_weight(weight, None)
    except (RuntimeError, AttributeError) as error:  # a build without the operator, or a refused weight
        logger.debug("oneDNN weight packing unavailable: %s", error)
        return None


# an activation of qkv.nn.layers.ACTIVATIONS -> oneDNN's post-op computing it in the product's own pass
# (its name, scalars, algorithm: "none" is GELU's exact erf form, "tanh" its tanh approximation)
_POST_OPS: dict[str | None, tuple[str, list, str]] = {
    None: ("none", [], ""),
    "relu": ("relu", [], ""),
    "gelu": ("gelu", [], "none"),
    "gelu_tanh": ("gelu", [], "tanh"),
}


def _packed_product(x: Tensor, packed: Tensor, bias: Tensor | None, activation: str | None = None) -> Tensor:
    if activation in _POST_OPS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, *_POST_OPS[activation])
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, *_POST_OPS[None])  # no post-op: applied after
    return ACTIVATIONS[activation](y)  # type: ignore[index]


class PackedLinear:
    """``F.linear(x, weight, bias)`` for 2-D float32 CPU inputs ``x (n, i)``, inference only (no
    autograd through the packed weight), oneDNN-packed where that is available and pays; with
    ``activation`` (a name of :data:`qkv.nn.layers.ACTIVATIONS`) that activation of it, computed by
    oneDNN in the product's pass where the weight is packed (a feed-forward network's first layer)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, activation: str | None = None) -> None:
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        self.weight = weight.detach()  # (o, i)
        self.bias = None if bias is None else bias.detach().clone()  # (o,)
        self.activation = activation
        self.packed: Tensor | None = None
        if PACK and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= MIN_WEIGHT:
            packed = _pack(self.weight)  # a reordered copy
            self.packed = packed if packed is not None and self._probe(packed) else None
        if self.packed is None:  # the product computes with the weights of this moment, whatever happens to them
            self.weight = self.weight.clone()

    def _probe(self, packed: Tensor) -> bool:
        """Whether the packed product runs and agrees with ``F.linear`` on a small random input."""
        x = torch.randn(3, self.weight.size(1), generator=torch.Generator().manual_seed(0))
        try:
            got = _packed_product(x, packed, self.bias, self.activation)
        except RuntimeError as error:
            logger.debug("oneDNN packed product failed, using F.linear: %s", error)
            return False
        want = self._unpacked(x)
        ok = got.shape == want.shape and bool((got - want).abs().max() <= _PROBE_TOLERANCE * want.abs().max())
        if not ok:
            logger.warning("oneDNN packed product disagrees with F.linear; decoding uses F.linear")
        return ok

    def __call__(self, x: Tensor) -> Tensor:
        """``x (n, i)`` -> ``(n, o)``."""
        if self.packed is None:
            return self._unpacked(x)
        if x.dtype == torch.float32:
            return _packed_product(x, self.packed, self.bias, self.activation)
        return _packed_product(x.float(), self.packed, self.bias, self.activation).to(x.dtype)

    def _unpacked(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.activation is None else ACTIVATIONS[self.activation](y)


def fuse(*pairs: tuple[Tensor, Tensor | None]) -> PackedLinear:
    """One :class:`PackedLinear` computing several same-input products at once (their outputs side by
    side).

    Args:
        pairs: ``(weight (o_j, i), bias (o_j,) or None)`` each; a missing bias counts as zeros.

    Returns:
        The product ``(n, i) -> (n, sum of o_j)``.
    """
    weight = torch.cat([w.detach() for w, _ in pairs])
    if all(b is None for _, b in pairs):
        return PackedLinear(weight)
    return PackedLinear(weight, torch.cat([w.new_zeros(w.size(0)) if b is None else b.detach() for w, b in pairs]))
