"""Attention weights for a forward pass that ran the fused kernel, recomputed exactly.

The fused kernel (``torch.nn.functional.scaled_dot_product_attention``) never forms the
``(s_q, s_k)`` weight matrix, so a model normally has to run its slow eager path to show weights.
:class:`AttentionRecorder` lets the forward pass run fast: a forward pre-hook on each chosen
:class:`~qkv.MultiHeadAttention` keeps a reference to the inputs it was called with (hidden
states, masks, cache), and afterwards :meth:`AttentionRecorder.weights` calls the same module
again on exactly those inputs with ``need_weights=True``. The weights are therefore the ones of
*that* forward pass (the same inputs, the same projections, the eager reference attention that
is qkv's spec), and only the requested modules pay for them.

Shape legend: ``b`` batch, ``h`` heads, ``s_q`` queries, ``s_k`` keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qkv.attention.multihead import MultiHeadAttention


@dataclass
class _Call:
    """The arguments of one recorded call of a MultiHeadAttention module."""

    args: tuple[object, ...]
    kwargs: dict[str, object] = field(default_factory=dict)


class AttentionRecorder:
    """Record the inputs of chosen attention modules during a forward pass; recompute their weights.

    Args:
        modules: name -> :class:`~qkv.MultiHeadAttention` to record (e.g. ``{"layer 0":
            model.layers[0].self_attn}``). Modules not listed run untouched.

    Example::

        with AttentionRecorder({f"{i}": layer.self_attn for i, layer in enumerate(model.layers)}) as rec:
            out = model(ids, mask)           # fused kernel, no weights formed
        weights = rec.weights()              # {"0": [(b, h, s, s)], ...} one tensor per call
    """

    def __init__(self, modules: Mapping[str, object]) -> None:
        self.modules: dict[str, MultiHeadAttention] = {}
        for name, module in modules.items():  # checked here: callers pass a model's layers' attributes
            if not isinstance(module, MultiHeadAttention):
                raise ValueError(f"{name!r} is a {type(module).__name__}, not a qkv MultiHeadAttention")
            self.modules[name] = module
        self.calls: dict[str, list[_Call]] = {name: [] for name in self.modules}
        self._handles: list[RemovableHandle] = []
        self._recomputing = False

    def __enter__(self) -> AttentionRecorder:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], None]:
        def record(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            if not self._recomputing:
                self.calls[name].append(_Call(tuple(args), dict(kwargs)))
            return None  # never changes the call

        return record

    @torch.no_grad()
    def weights(self) -> dict[str, list[Tensor]]:
        """Recompute the weights of every recorded call.

        Returns:
            name -> one ``(b, h, s_q, s_k)`` tensor per recorded call, in call order.
        """
        out: dict[str, list[Tensor]] = {}
        self._recomputing = True
        try:
            for name, module in self.modules.items():
                out[name] = []
                for call in self.calls[name]:
                    kwargs = dict(call.kwargs, need_weights=True)
                    out[name].append(module(*call.args, **kwargs).weights)
        finally:
            self._recomputing = False
        return out
