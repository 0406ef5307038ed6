"""Linear layers for CPU decoding in float32, with their weights packed once for oneDNN.

A decoding step multiplies a few rows (the sentences, times the beam) by every weight matrix. On the
CPUs qkv is measured on, PyTorch's float32 ``F.linear`` (MKL) is slow at that shape: a 16 x 256 input
times the 256 x 8,000 vocabulary projection took 3-4 ms on the AVX2 EPYC, against 2.3 ms for oneDNN
with the weight reordered ("packed") into its blocked layout once, instead of on every call
(benchmarks/results/deploy/decoding_profile.json has the step's profile). :class:`PackedLinear` packs a
weight the first time it is built for it (again after the weight changed in place) and multiplies
through oneDNN; it computes ``F.linear(x, weight, bias)`` up to float32 rounding (the
sums are taken in another order), which tests/test_decoding_speedpath.py holds to 1e-5.

Which weights are packed depends on the CPU's vector width (:data:`MIN_WEIGHT`). With AVX2 only, large
weights alone (the vocabulary projection): on 16-80 rows the packed product took 0.55-0.65x of
``F.linear``'s time for the 256 x 8,000 projection but 0.9-1.4x for the 256 x 256-1,024 ones (1 thread,
the 2-core AVX2 EPYC; packing every weight made the whole decoding slower there). With AVX512, every
weight: oneDNN computes with AVX512 there, while the MKL in PyTorch's wheels does not on AMD CPUs; with
it and the rest of qkv 1.4.0's changes, Multi30k's decoding went from 1.57x CTranslate2 float32's time
to 1.10x (greedy) and from 1.59x to 1.15x (beam 5) at 1 thread on a 2-core AVX512 EPYC
(benchmarks/results/deploy/decoding_engines_zen5_avx512.json, docs/deploy.md).

A packed weight is known by its tensor, its data's address and its version counter, which PyTorch bumps
on every in-place change, except that its fused optimizers (``fused=True``) change weights without
bumping it: qkv's :class:`~qkv.training.Trainer` bumps them itself after such a step. Code of your own
that changes weights that way (or through ``.data``) between decoding calls should do the same
(``torch.autograd.graph.increment_version``), or decoding computes with the weights it packed before.

oneDNN's packed product is a private PyTorch operator (``torch.ops.mkldnn``): where it is missing,
refuses the weight, or disagrees with ``F.linear`` on a probe, :class:`PackedLinear` falls back to
``F.linear`` for good.

Shape legend: ``n`` rows, ``i`` input features, ``o`` output features.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

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
# weight -> ((its version, its data's address) when packed, its packed form or None): a model's weights are packed once, not on
# every decoding call, and again once they change in place (an optimizer step bumps the version; qkv's
# Trainer bumps it after a fused one, which does not)
_PACKED_WEIGHTS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


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
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, *_POST_OPS[activation])


class PackedLinear:
    """``F.linear(x, weight, bias)`` for 2-D float32 CPU inputs ``x (n, i)``, inference only (no
    autograd through the packed weight), oneDNN-packed where that is available and pays; with
    ``activation`` (a name of :data:`qkv.nn.layers.ACTIVATIONS`) that activation of it, computed by
    oneDNN in the product's pass where the weight is packed (a feed-forward network's first layer)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, activation: str | None = None) -> None:
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        self.weight = weight.detach()  # (o, i)
        self.bias = None if bias is None else bias.detach()  # (o,)
        self.activation = activation
        self.packed: Tensor | None = None
        if PACK and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= MIN_WEIGHT:
            self.packed = self._packed(weight)

    def _packed(self, weight: Tensor) -> Tensor | None:
        """``weight`` packed, from :data:`_PACKED_WEIGHTS` when it has not changed since (a tensor made under
        ``torch.inference_mode``, which keeps no version, is packed every time)."""
        state = None if weight.is_inference() else (weight._version, weight.data_ptr())
        known, packed = _PACKED_WEIGHTS.get(weight, (None, None)) if state is not None else (None, None)
        if state is not None and known == state:
            return packed
        packed = _pack(self.weight)
        if packed is not None and not self._probe(packed):
            packed = None
        if state is not None:
            _PACKED_WEIGHTS[weight] = (state, packed)
        return packed

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
        if self.packed is not None and x.dtype == torch.float32:
            return _packed_product(x, self.packed, self.bias, self.activation)
        return self._unpacked(x)

    def _unpacked(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.activation is None else ACTIVATIONS[self.activation](y)


# a model's first weight of a fused product -> (the state of every weight and bias fused, the product):
# the concatenated weight is built (and packed) once, not on every decoding call
_FUSED: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def fuse(*pairs: tuple[Tensor, Tensor | None]) -> PackedLinear:
    """One :class:`PackedLinear` computing several same-input products at once (their outputs side by
    side): ``pairs`` of ``(weight (o_j, i), bias (o_j,) or None)``; a missing bias counts as zeros. The
    same weights (unchanged since) give the same product again, built and packed once."""
    parts = [t for pair in pairs for t in pair if t is not None]
    state = None if any(t.is_inference() for t in parts) else tuple((t._version, t.data_ptr()) for t in parts)
    first = pairs[0][0]
    known, product = _FUSED.get(first, (None, None)) if state is not None else (None, None)
    if state is not None and known == (state, len(pairs)) and product is not None:
        return product
    weight = torch.cat([w.detach() for w, _ in pairs])
    if all(b is None for _, b in pairs):
        product = PackedLinear(weight)
    else:
        product = PackedLinear(
            weight, torch.cat([w.new_zeros(w.size(0)) if b is None else b.detach() for w, b in pairs])
        )
    if state is not None:
        _FUSED[first] = ((state, len(pairs)), product)
    return product
