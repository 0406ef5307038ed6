"""Mask functions in the manner of FlexAttention: a mask is a function of positions, composed, then
made a dense boolean mask (any device) or a FlexAttention block mask (where that is faster).

A mask function has FlexAttention's ``mask_mod`` signature ``fn(b, h, q_idx, kv_idx) -> bool tensor``
on index tensors that broadcast together: True where the query at absolute position ``q_idx`` may
attend to the key at ``kv_idx`` (the convention of :mod:`qkv.attention.masks`). Elementwise operations
and indexing only, so one function runs on broadcast index grids (:func:`to_bool_mask`) and under
FlexAttention's ``vmap`` and ``torch.compile``. Positions are absolute: cached decoding's queries start
at ``q_offset``, a cache that dropped its oldest keys starts at ``kv_offset``, and a tensor a function
reads (document ids, real-token flags) is indexed by absolute position.

Shape legend: ``b`` batch, ``h`` heads, ``s_q`` queries, ``s_k`` keys, ``d`` head size.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.functional import scaled_dot_product_attention

logger = logging.getLogger(__name__)

MaskFunction = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # fn(b, h, q_idx, kv_idx) -> bool tensor

FLEX_BLOCK = 128  # FlexAttention's default tile of queries and keys
FLEX_MIN_QUERIES = 1024  # shorter query blocks take the boolean path (see flex_is_faster)
FLEX_MAX_SHAPES = 8  # torch's recompile_limit: kernels compiled before new ones take the boolean path
_flex_compiled: set[tuple[Any, ...]] = set()  # what the compiled kernels were specialised to
_flex_failed: list[str] = []  # why compiling FlexAttention failed here, once it has


# ----------------------------------------------------------------------------- the mask functions
def causal() -> MaskFunction:
    """A query sees the keys at its own position and before.

    Returns:
        The mask function ``kv_idx <= q_idx``.
    """

    def causal_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx

    return causal_fn


def sliding_window(window: int) -> MaskFunction:
    """Causal attention within a window: the query at position ``i`` sees keys ``i - window + 1 .. i``.

    Args:
        window: keys each query sees, itself included (at least 1).

    Returns:
        The mask function ``q_idx - window < kv_idx <= q_idx``.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer of at least 1, got {window!r}")

    def sliding_window_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return sliding_window_fn


def document(doc_ids: Tensor) -> MaskFunction:
    """Attention within a document only, for sequences that pack several documents (not causal by
    itself: compose it with :func:`causal`).

    Args:
        doc_ids: ``(b, s)`` integer document id of each absolute position.

    Returns:
        The mask function ``doc_ids[b, q_idx] == doc_ids[b, kv_idx]``.
    """
    if doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must be an integer tensor (b, s), got {doc_ids.dtype} {tuple(doc_ids.shape)}")

    def document_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]

    return document_fn


def prefix(length: int | Tensor) -> MaskFunction:
    """A prefix language model: every query sees the whole prefix, and is causal after it.

    Args:
        length: the prefix length, one for all sequences or a ``(b,)`` integer tensor.

    Returns:
        The mask function ``kv_idx < length[b] or kv_idx <= q_idx``.
    """
    if isinstance(length, Tensor):
        if length.dim() != 1 or length.dtype.is_floating_point or length.dtype == torch.bool:
            raise ValueError(
                f"length must be an int or an integer tensor (b,), got {length.dtype} {tuple(length.shape)}"
            )
    elif isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int or an integer tensor (b,), got {length!r}")

    def prefix_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx < (length[b] if isinstance(length, Tensor) else length)) | (kv_idx <= q_idx)

    return prefix_fn


def padding(real: Tensor) -> MaskFunction:
    """Keys that are real tokens (a key padding mask as a mask function).

    Args:
        real: ``(b, s_k)`` bool, True where the key at that absolute position is a real token.

    Returns:
        The mask function ``real[b, kv_idx]``.
    """
    if real.dim() != 2 or real.dtype != torch.bool:
        raise ValueError(f"real must be a bool tensor (b, s_k), got {real.dtype} {tuple(real.shape)}")

    def padding_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return real[b, kv_idx]

    return padding_fn


def and_masks(*fns: MaskFunction) -> MaskFunction:
    """A key is seen when every function lets it be seen.

    Args:
        fns: one or more mask functions.

    Returns:
        The mask function of their logical AND.
    """
    return _combined(torch.logical_and, "and_masks", fns)


def or_masks(*fns: MaskFunction) -> MaskFunction:
    """A key is seen when any function lets it be seen.

    Args:
        fns: one or more mask functions.

    Returns:
        The mask function of their logical OR.
    """
    return _combined(torch.logical_or, "or_masks", fns)


def _combined(op: Callable[[Tensor, Tensor], Tensor], name: str, fns: tuple[MaskFunction, ...]) -> MaskFunction:
    if not fns:
        raise ValueError(f"{name} needs at least one mask function")

    def combined_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return functools.reduce(op, (fn(b, h, q_idx, kv_idx) for fn in fns))

    return combined_fn


# ----------------------------------------------------------------------------- the dense boolean mask
def to_bool_mask(
    fn: MaskFunction,
    b: int,
    h: int,
    s_q: int,
    s_k: int,
    *,
    q_offset: int = 0,
    kv_offset: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """The dense boolean mask of ``fn``, built by calling it once on broadcast index tensors.

    Args:
        fn: the mask function.
        b: batch size. h: number of heads.
        s_q: number of queries, at absolute positions ``q_offset .. q_offset + s_q - 1``.
        s_k: number of keys, at absolute positions ``kv_offset .. kv_offset + s_k - 1``.
        q_offset: the first query's position (cached decoding: the keys already in the cache).
        kv_offset: the first key's position (a cache that dropped its oldest keys).
        device: where to build the index tensors; tensors ``fn`` reads must be there too.

    Returns:
        Bool tensor ``(b or 1, h or 1, s_q, s_k)``, True where the query may attend; a leading dim is 1
        where ``fn`` does not depend on it.
    """
    sizes = dict(b=b, h=h, s_q=s_q, s_k=s_k, q_offset=q_offset, kv_offset=kv_offset)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    b_idx = torch.arange(b, device=device).view(b, 1, 1, 1)
    h_idx = torch.arange(h, device=device).view(1, h, 1, 1)
    q_idx = torch.arange(q_offset, q_offset + s_q, device=device).view(1, 1, s_q, 1)
    kv_idx = torch.arange(kv_offset, kv_offset + s_k, device=device).view(1, 1, 1, s_k)
    mask = torch.as_tensor(fn(b_idx, h_idx, q_idx, kv_idx), device=device)
    if mask.dtype != torch.bool:
        raise ValueError(f"a mask function must return a bool tensor, got {mask.dtype}")
    mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    if mask.dim() > 4 or mask.size(0) not in (1, b) or mask.size(1) not in (1, h):
        raise ValueError(f"a mask function returned shape {tuple(mask.shape)}, not broadcastable to {(b, h, s_q, s_k)}")
    return mask.expand(mask.size(0), mask.size(1), s_q, s_k).contiguous()  # (b or 1, h or 1, s_q, s_k)


# ----------------------------------------------------------------------------- FlexAttention
@functools.cache
def flex_available() -> bool:
    """Whether this torch has ``torch.nn.attention.flex_attention``.

    Returns:
        True when it imports.
    """
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def shifted(
    fn: MaskFunction, q_offset: int = 0, kv_offset: int = 0, *, device: torch.device | str | None = None
) -> MaskFunction:
    """``fn`` on FlexAttention's indices (each counted from 0) moved to absolute positions.

    Args:
        fn: the mask function. q_offset: the first query's position. kv_offset: the first key's.
        device: where the attention runs.

    Returns:
        ``fn`` itself when both offsets are 0, else a mask function adding them. The offsets are held as
        0-dim tensors, so a compiled kernel is not specialised to (and recompiled for) each value.
    """
    if q_offset == 0 and kv_offset == 0:
        return fn
    q_shift, kv_shift = torch.tensor(q_offset, device=device), torch.tensor(kv_offset, device=device)

    def shifted_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return fn(b, h, q_idx + q_shift, kv_idx + kv_shift)

    return shifted_fn


def flex_block_mask(
    fn: MaskFunction,
    b: int,
    h: int,
    s_q: int,
    s_k: int,
    *,
    q_offset: int = 0,
    kv_offset: int = 0,
    device: torch.device | str | None = None,
) -> Any:
    """FlexAttention's ``BlockMask`` of ``fn``, made from its dense boolean mask.

    ``torch``'s ``create_block_mask`` evaluates ``fn`` under ``vmap``; the dense mask of
    :func:`to_bool_mask` is one broadcast call, and its tiles give the block lists directly (the tests
    hold the two to the same tiles). Either costs about as much as the attention call it serves, so
    build it once per forward pass and give it to every layer's :func:`attend_with_mask_function`.

    Args:
        fn, b, h, s_q, s_k, q_offset, kv_offset, device: as for :func:`to_bool_mask`.

    Returns:
        A ``torch.nn.attention.flex_attention.BlockMask`` for ``(b or 1, h or 1, s_q, s_k)``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    mask = to_bool_mask(fn, b, h, s_q, s_k, q_offset=q_offset, kv_offset=kv_offset, device=device)
    n_q, n_k = -(-s_q // FLEX_BLOCK), -(-s_k // FLEX_BLOCK)
    padded = F.pad(mask, (0, n_k * FLEX_BLOCK - s_k, 0, n_q * FLEX_BLOCK - s_q))  # padding is False
    tiles = padded.view(mask.size(0), mask.size(1), n_q, FLEX_BLOCK, n_k, FLEX_BLOCK)
    seen = tiles.any(dim=5).any(dim=3)  # (b', h', n_q, n_k): a tile with any key seen
    full = tiles.all(dim=5).all(dim=3)  # a tile seen whole: the kernel skips fn there

    def block_lists(tiles_kept: Tensor) -> tuple[Tensor, Tensor]:
        counts = tiles_kept.sum(dim=-1, dtype=torch.int32)  # (b', h', n_q)
        order = torch.argsort(tiles_kept.to(torch.int8), dim=-1, descending=True, stable=True)
        return counts, order.to(torch.int32)  # the kept tiles' key-block indices first

    mask_mod = shifted(fn, q_offset, kv_offset, device=mask.device)
    lists = (*block_lists(seen & ~full), *block_lists(full))  # the partial tiles, then the full ones
    return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(s_q, s_k))


def flex_is_faster(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float = 0.0) -> bool:
    """Whether compiled FlexAttention is the faster way to attend with a mask function here.

    The rule comes from ``benchmarks/mask_functions.py`` (causal and causal + window at 256, 1024 and
    2048 positions, ``b=1``, ``h=4``, ``d=64``, float32, on an AMD EPYC with 1 and 2 threads; the figures
    are in ``benchmarks/results/attention/mask_functions_epyc.json``):

    * on CPU, FlexAttention runs forward only (torch refuses inputs that require grad), so training
      keeps the boolean mask; it has no dropout either;
    * run eagerly it materialises the whole score matrix and is several times slower than the boolean
      path at every length, so only the compiled kernel is used;
    * compiled, it is faster per call from 1024 positions on, causal or not, and most with a window
      (it skips the tiles the window leaves out); at 256 the two are close. Compiling costs seconds
      for each new shape, so query blocks shorter than ``FLEX_MIN_QUERIES`` (decoding steps, short
      prompts: many lengths, little to gain) keep the boolean path, and long ones (a long prompt,
      scoring a document: few shapes, each run once per layer) take FlexAttention;
    * on other devices and dtypes it has not been measured, so the boolean path (torch's fused kernel
      with the mask) stays.

    Args:
        q: queries ``(b, h, s_q, d)``. k: keys ``(b, h, s_k, d)``. v: values ``(b, h, s_k, d_v)``.
        dropout_p: the attention dropout.

    Returns:
        True where :func:`attend_with_mask_function` should use FlexAttention.
    """
    if not flex_available() or _flex_failed or dropout_p > 0.0 or q.requires_grad or k.requires_grad or v.requires_grad:
        return False
    return q.device.type == "cpu" and q.dtype == torch.float32 and q.dim() == 4 and q.size(-2) >= FLEX_MIN_QUERIES


def _function_key(value: Any) -> Any:
    """What a compiled kernel is specialised to in a mask function: its code and the non-tensor values
    it holds (windows 64 and 128 compile apart, two document-id tensors of one shape do not)."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return tuple(_function_key(item) for item in value)
    code = getattr(value, "__code__", None)
    if code is not None:
        cells = getattr(value, "__closure__", None) or ()
        return (code, tuple(_function_key(cell.cell_contents) for cell in cells))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return ("object", id(value))


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attend_with_mask_function(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fn: MaskFunction,
    *,
    q_offset: int = 0,
    kv_offset: int = 0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_mask: Any = None,
    use_flex: bool | None = None,
) -> Tensor:
    """Scaled dot-product attention under the mask function ``fn``.

    Runs compiled FlexAttention where :func:`flex_is_faster` says so, else the dense boolean mask of
    ``fn`` with :func:`qkv.scaled_dot_product_attention`. Both give a query that sees no key a zero
    output row, never NaN (FlexAttention does this itself; the tests hold it to that). After
    ``FLEX_MAX_SHAPES`` compiled kernels (shapes, mask functions), torch would run new ones with the
    slow eager kernel, so the automatic choice takes the boolean path for them; if compiling fails
    here (no C++ compiler), it is logged once and the boolean path serves from then on.

    Args:
        q: queries ``(b, h, s_q, d)``. k: keys ``(b, h, s_k, d)``. v: values ``(b, h, s_k, d_v)``.
        fn: the mask function.
        q_offset: the first query's absolute position. kv_offset: the first key's.
        scale: factor on ``q k^T``; defaults to ``1 / sqrt(d)``.
        dropout_p: dropout on the attention weights (the boolean path only).
        block_mask: a :func:`flex_block_mask` of ``fn`` for these shapes and offsets, built once for
            all layers; built here when the flex path needs one and none is given.
        use_flex: force the flex path (True) or the boolean path (False); None lets
            :func:`flex_is_faster` decide.

    Returns:
        ``(b, h, s_q, d_v)``.
    """
    if q.dim() != 4:
        raise ValueError(f"q, k, v must be (b, h, seq, d); got q of shape {tuple(q.shape)}")
    b, h, s_q, s_k = q.size(0), q.size(1), q.size(2), k.size(2)
    flex = flex_is_faster(q, k, v, dropout_p=dropout_p) if use_flex is None else use_flex
    if flex:
        if dropout_p > 0.0:
            raise ValueError(f"the flex path has no dropout; got dropout_p={dropout_p}")
        key = (q.shape, k.shape, v.shape, q.dtype, q.device, _function_key(fn), q_offset != 0 or kv_offset != 0)
        flex = use_flex is True or key in _flex_compiled or len(_flex_compiled) < FLEX_MAX_SHAPES
    if flex:
        if block_mask is None:
            block_mask = flex_block_mask(fn, b, h, s_q, s_k, q_offset=q_offset, kv_offset=kv_offset, device=q.device)
        try:
            out = _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale)
        except Exception as err:  # noqa: BLE001 - no compiler, an unsupported case: the boolean path serves
            if use_flex:
                raise
            _flex_failed.append(f"{type(err).__name__}: {err}".splitlines()[0])
            logger.warning("compiled FlexAttention failed here, using boolean masks from now on: %s", _flex_failed[0])
        else:
            _flex_compiled.add(key)
            return out
    mask = to_bool_mask(fn, b, h, s_q, s_k, q_offset=q_offset, kv_offset=kv_offset, device=q.device)
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
