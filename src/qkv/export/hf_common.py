"""What both Hugging Face exports (:mod:`qkv.export.huggingface`, :mod:`qkv.export.hf_gpt2`) share:
the activation names and the logits check of a reloaded folder."""

from __future__ import annotations

import torch
from torch import Tensor

# qkv activation -> the ``transformers`` activation_function computing the same function
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
PROBE_TOLERANCE = 1e-4  # float32 logits of the reloaded folder vs qkv's (same function, other kernels)


def probe_ids(vocab: int, first: int, rows: int = 2, length: int = 7, seed: int = 0) -> Tensor:
    """A small batch ``(rows, length)`` of token ids ``first .. vocab-1`` from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(first, vocab, (rows, length), generator=generator)


def check_same_logits(name: str, ours: Tensor, theirs: Tensor) -> None:
    """RuntimeError when the exported folder's logits differ from qkv's beyond :data:`PROBE_TOLERANCE`."""
    diff = (ours.float() - theirs.float()).abs().max().item()
    if diff > PROBE_TOLERANCE:
        raise RuntimeError(f"the exported {name} differs from the run's model (max |logit diff| {diff:.2e})")
