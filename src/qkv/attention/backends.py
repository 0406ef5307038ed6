"""Fast paths for attention and the record of why a call fell back to the eager reference.

The eager reference in :mod:`qkv.attention.functional` is the spec. When the caller does not need
the attention weights, the same function is computed by PyTorch's fused
``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient / math kernels),
which never materialises the ``(s_q, s_k)`` weight matrix. Every fast path is tested against the
reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.masks import causal_mask

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch_sdpa", "reference")
_forced_backend: contextvars.ContextVar[str] = contextvars.ContextVar("qkv_backend", default="auto")
# torch.compile cannot trace ContextVar.get (a graph break in every attention call), so a plain
# module-level mirror is read while compiling; dynamo guards on its value and recompiles if it changes.
_forced_backend_mirror = "auto"


@dataclass(frozen=True)
class BackendChoice:
    """Which implementation a call runs, and why it is not the fast path when it is not."""

    backend: str  # "torch_sdpa" or "reference"
    reason: str | None = None  # why the reference ran; None when the fast path ran


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force an attention backend inside a ``with`` block: ``"auto"``, ``"torch_sdpa"`` or
    ``"reference"``. ``"torch_sdpa"`` still falls back when weights are requested."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    global _forced_backend_mirror
    token = _forced_backend.set(name)
    previous, _forced_backend_mirror = _forced_backend_mirror, name
    try:
        yield
    finally:
        _forced_backend.reset(token)
        _forced_backend_mirror = previous


def forced_backend() -> str:
    """The backend forced by the innermost :func:`use_backend` block (``"auto"`` outside any)."""
    if torch.compiler.is_compiling():
        return _forced_backend_mirror
    return _forced_backend.get()


def select_backend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    need_weights: bool,
) -> BackendChoice:
    """Pick the implementation for one attention call; log the reason when it is the reference."""
    forced = forced_backend()
    if need_weights:
        choice = BackendChoice("reference", "need_weights=True: the fused kernel does not return weights")
    elif forced == "reference":
        choice = BackendChoice("reference", "forced by qkv.attention.backends.use_backend('reference')")
    elif plain_is_faster(q, k, v):
        return BackendChoice("reference", "CPU, short sequences, a backward to follow: the plain products are faster")
    else:
        return BackendChoice("torch_sdpa")
    logger.debug("attention fell back to the eager reference: %s", choice.reason)
    return choice


def torch_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool = False,
) -> Tensor:
    """Attention through ``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``: ``k`` and
    ``v`` hold fewer heads than ``q``, each serving ``h_q / h_kv`` consecutive query heads).

    Bridges the two places where PyTorch's conventions differ from qkv's:
    * PyTorch aligns ``is_causal`` top-left when ``s_q != s_k``; qkv aligns bottom-right, so an
      explicit mask is built for unequal lengths (a single query sees every key: no mask).
    * Fully masked rows: PyTorch's CPU kernels return zeros; other devices' kernels may return
      NaN, so there such rows are un-masked for the kernel and zeroed afterwards.

    And one place where it is slow: on CPU, the fused kernel's bfloat16/float16 *backward* is 2-5x
    slower than its float32 one for short sequences (below 192 positions: the kernel's small-tile
    path), so there, when gradients will be needed, the kernel runs in float32 and the output is
    cast back (see :func:`upcast_for_cpu_backward`).
    """
    if q.dtype in _LOW_PRECISION and upcast_for_cpu_backward(q, k, v):
        return in_float32(torch_sdpa, q, k, v, attn_mask, is_causal, dropout_p, scale, enable_gqa)
    s_q, s_k = q.shape[-2], k.shape[-2]
    if is_causal and s_q != s_k:
        if s_q == 1:
            is_causal = False  # the one new query sees every key
        else:
            causal = causal_mask(s_q, s_k, device=q.device)
            attn_mask = causal if attn_mask is None else _and_mask(attn_mask, causal)
            is_causal = False
    if attn_mask is None:  # the common case, kept short: this runs on every call
        if dropout_p == 0.0 and scale is None and not enable_gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    if is_causal:
        attn_mask = _and_mask(attn_mask, causal_mask(s_q, s_k, device=q.device))
        is_causal = False
    fully_masked = None
    if q.device.type != "cpu":
        keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")
        fully_masked = ~keep.any(dim=-1, keepdim=True)  # (..., s_q, 1)
        attn_mask = attn_mask.masked_fill(fully_masked, True if attn_mask.dtype == torch.bool else 0.0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    if fully_masked is not None:
        out = out.masked_fill(fully_masked, 0.0)
    return out


_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Below this many queries and keys, torch's CPU flash kernel uses small tiles and its bf16/fp16
# backward is slower than float32's, so low-precision inputs are upcast for the kernel (the
# measurements: docs/history/code-comments.md).
UPCAST_MAX_LEN = 192
# Below this many queries and keys, on CPU, with a backward pass to follow, the plain product-softmax-
# product (attention_reference) in float32 beats the fused kernel in float32. Low-precision inputs are
# computed in float32 too, like the kernel's upcast above: plain products in bfloat16 are faster but
# trained to a worse validation loss (the measurements: docs/history/code-comments.md).
PLAIN_MAX_LEN = 64


def in_float32(attention: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, *args: object) -> Tensor:
    """``attention(q, k, v, *args)`` computed in float32 for bfloat16/float16 inputs, whatever the
    autocast, and rounded once to their dtype; other inputs as they are."""
    if q.dtype not in _LOW_PRECISION:
        return attention(q, k, v, *args)
    with torch.autocast(q.device.type, enabled=False):  # autocast would cast the products straight back
        out = attention(q.float(), k.float(), v.float(), *args)
    return out.to(q.dtype)


def _backward_follows(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def plain_is_faster(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether to run the eager reference (in float32) instead of the fused kernel for speed: on
    CPU, when autograd will need a backward pass, for sequences shorter than :data:`PLAIN_MAX_LEN`
    (training on sentences). The same choice while compiling, so compiled and eager code compute
    the same."""
    return _backward_follows(q, k, v) and q.device.type == "cpu" and max(q.shape[-2], k.shape[-2]) < PLAIN_MAX_LEN


def upcast_for_cpu_backward(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether to run the fused kernel in float32 for low-precision inputs: on CPU, short
    sequences (< :data:`UPCAST_MAX_LEN`), and only when autograd will need a backward pass."""
    return (
        q.device.type == "cpu"
        and q.dtype in _LOW_PRECISION
        and max(q.shape[-2], k.shape[-2]) < UPCAST_MAX_LEN
        and _backward_follows(q, k, v)
    )


def _and_mask(attn_mask: Tensor, causal: Tensor) -> Tensor:
    """Apply a boolean causal mask on top of a bool or additive mask."""
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))
