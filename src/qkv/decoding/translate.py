"""Translate lists of sentences in length-sorted batches (greedy or beam search), the way
validation, ``qkv translate`` and ``qkv evaluate`` do. Scoring: :mod:`qkv.metrics`.
"""

from __future__ import annotations

import logging
import warnings

from tqdm.auto import tqdm

from qkv.data.batching import pad_sequences
from qkv.data.tokenizer import Tokenizer
from qkv.decoding.inference import InferenceModel
from qkv.decoding.search import PenaltyForm, beam_search, greedy_decode
from qkv.decoding.steps import Decodable, for_decoding
from qkv.runtime.precision import autocast_context

logger = logging.getLogger(__name__)


def translate_texts(
    model: Decodable,
    tokenizer: Tokenizer,
    texts: list[str],
    *,
    beam_size: int = 1,
    alpha: float = 0.6,
    penalty: PenaltyForm = "gnmt",
    max_batch_tokens: int = 4000,
    bf16: bool = False,
    progress: bool = False,
    max_tokens: int | None = None,
) -> list[str]:
    """Translate ``texts`` (batched by length; output in input order).

    Args:
        model: trained :class:`~qkv.models.transformer.Transformer` (it is put in eval mode; a float32
            one on the CPU is decoded through an :class:`~qkv.decoding.inference.InferenceModel` built
            once for this call), an :class:`~qkv.decoding.ensemble.Ensemble`, or an ``InferenceModel``
            the caller built and keeps.
        tokenizer: the run's tokenizer.
        texts: source sentences.
        beam_size: 1 = greedy decoding, else beam search with length penalty ``alpha``.
        alpha: the length penalty's exponent.
        penalty: its form, ``"gnmt"`` (qkv's) or ``"power"`` (Hugging Face's and CTranslate2's);
            see :func:`qkv.decoding.search.length_penalty`.
        max_batch_tokens: source tokens per batch (times ``beam_size`` rows are decoded).
        bf16: run under bfloat16 autocast (faster on CPUs with bf16 matrix units).
        progress: show a progress bar.
        max_tokens: the old keyword of ``max_batch_tokens`` (deprecated).

    Returns:
        the translations, one per input sentence.
    """
    if max_tokens is not None:
        warnings.warn("translate_texts: max_tokens= is now max_batch_tokens=", DeprecationWarning, stacklevel=2)
        max_batch_tokens = max_tokens
    model.eval()
    limit = model.config.max_len - 1  # source tokens that fit the positional table with EOS
    encoded = tokenizer.encode_batch(texts)
    too_long = sum(len(s) > limit for s in encoded)
    ids = [s[:limit] + [tokenizer.eos_id] for s in encoded]
    if too_long:
        logger.warning(
            "%d %s longer than %d tokens %s cut to fit the model",
            too_long,
            "sentence" if too_long == 1 else "sentences",
            limit,
            "was" if too_long == 1 else "were",
        )
    results: list[str] = [""] * len(ids)
    batches = length_batches(ids, max(1, max_batch_tokens // max(1, beam_size)))
    device = model.device if isinstance(model, InferenceModel) else next(model.parameters()).device
    with autocast_context(device, bf16):
        if batches:
            model = for_decoding(model)  # built once for all the batches (under the autocast it decides on)
        for batch in tqdm(batches, desc="translating", disable=not progress, leave=False):
            src = pad_sequences([ids[i] for i in batch], model.config.pad_id).to(device)
            bos_id, eos_id = tokenizer.bos_id, tokenizer.eos_id
            if beam_size == 1:
                out = greedy_decode(model, src, bos_id=bos_id, eos_id=eos_id)
            else:
                out = beam_search(
                    model, src, bos_id=bos_id, eos_id=eos_id, beam_size=beam_size, alpha=alpha, penalty=penalty
                )
            for i, tokens in zip(batch, out):
                results[i] = tokenizer.decode(tokens)
    return results


def length_batches(ids: list[list[int]], budget: int) -> list[list[int]]:
    """Group the indices of ``ids`` (token lists) into batches of similar length, shortest first, each
    holding at most ``budget`` tokens once padded to its longest (a longer sentence gets a batch of
    its own)."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(ids)), key=lambda i: len(ids[i])):
        if current and len(ids[i]) * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
