"""Building a model on PyTorch's ``meta`` device (shapes and dtypes, no storage), without the compiler.

qkv builds models on the meta device to check a run's config against its weights before building it
for real (:mod:`qkv.runtime.safe_load`) and to count a size's parameters (the language model's budget
rule, :mod:`qkv.runs.recipes.budget`). There, PyTorch computes a tensor's ``normal_`` (every
``nn.Embedding``'s initialisation, and qkv's own) through its Python reference, which imports
``torch._dynamo``: 2.5 s on the 2-core EPYC, which ``qkv train`` paid before parsing its options (the
language model's budget rule counts its sizes' parameters), and every command that loads a run. A
meta tensor holds no values to fill, so :func:`meta_device` skips that fill; every other call is
PyTorch's. Other operators take the same path on the meta device (``arange``, ``exp``, ``sin``,
``cos``): the sinusoidal positions' table (:func:`qkv.nn.positional.sinusoidal_table`) computes
nothing there, so loading a translation run does not import the compiler either.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_NORMAL_FILLS: set[Any] = {torch.Tensor.normal_, torch.nn.init.normal_}


class _SkipMetaFills(TorchFunctionMode):
    """Returns a meta tensor from ``normal_`` unchanged (it has no values); passes everything else on."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _NORMAL_FILLS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init.normal_ passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device() -> Iterator[None]:
    """``with meta_device(): model = build()``: the model's tensors on the meta device, as under
    ``torch.device("meta")``, with ``normal_`` leaving them as they are instead of importing ``torch._dynamo``."""
    with torch.device("meta"), _SkipMetaFills():
        yield
