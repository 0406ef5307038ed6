"""Tasks: what one kind of model trains on. The engine (:mod:`qkv.training.engine`) owns the loop,
the optimizer, checkpoints and processes; a task supplies

- ``num_examples`` and ``batches(epoch, max_tokens, seed)``: the epoch's batches as example
  indices, the same on every process (each takes its share);
- ``make_batch(indices, epoch)``: a padded :class:`~qkv.data.batching.Batch` (``epoch`` lets a task
  vary an example from pass to pass: subword dropout);
- ``loss(model, batch, objective)``: the summed loss over the batch's target tokens under a training
  objective (:mod:`qkv.training.objectives`: label-smoothed cross-entropy, R-Drop), through
  ``loss_fn(model, *tensors, **loss_keywords(objective))`` (what the engine wraps for DDP and FSDP2);
- ``validate(model, sentences, bf16)``: a record of validation figures, with ``score`` (higher is
  better; picks ``best.safetensors``) and ``exact_match``.

:class:`TranslationTask` is the encoder-decoder one (BLEU/chrF, exact match for the date task);
:class:`~qkv.training.language_model_task.LanguageModelTask` the decoder-only one (loss, perplexity,
bits per character; imported here too). A batch is anything with ``to(device)`` and ``num_tgt_tokens``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

from qkv.data.batching import Batch, BatchPlan, bucket_batches, make_batch, token_batches
from qkv.data.parallel import ParallelText
from qkv.data.subword_dropout import SubwordDropout
from qkv.data.tokenizer import Tokenizer
from qkv.decoding.translate import translate_texts
from qkv.metrics.scores import exact_match, score_translations
from qkv.models.transformer import Transformer
from qkv.runtime.device import model_device
from qkv.runtime.precision import autocast_context
from qkv.training.language_model_task import LanguageModelTask, WindowBatch, language_model_loss
from qkv.training.objectives import LabelSmoothedCrossEntropy, Objective, Predictions, loss_keywords, stacked

__all__ = [
    "LanguageModelTask",
    "TokenLists",
    "TranslationTask",
    "WindowBatch",
    "encode_pairs",
    "language_model_loss",
    "translation_loss",
]

logger = logging.getLogger(__name__)


def encode_pairs(
    tokenizer: Tokenizer, data: ParallelText, max_len: int, *, what: str = "training"
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Tokenise ``data`` and drop the pairs that do not fit a model of ``max_len`` positions
    (source + EOS, or BOS + target, longer than ``max_len``), logging how many and the first
    one's file and line, so an over-long line never surfaces as a crash in the middle of a run.

    Returns:
        ``(source ids, target ids, kept indices into data)``.
    """
    src_all, tgt_all = tokenizer.encode_batch(data.src), tokenizer.encode_batch(data.tgt)
    fits = [len(s) + 1 <= max_len and len(t) + 1 <= max_len for s, t in zip(src_all, tgt_all)]
    kept = [i for i, ok in enumerate(fits) if ok]
    if len(kept) < len(fits):
        first = fits.index(False)
        where = f"{data.src_path or 'source'}:{first + 1} / {data.tgt_path or 'target'}:{first + 1}"
        logger.warning(
            "dropped %d of %d %s pairs longer than the model's %d positions (first: %s, %d and %d "
            "tokens); pass a larger --max-len to keep them",
            len(fits) - len(kept),
            len(fits),
            what,
            max_len,
            where,
            len(src_all[first]),
            len(tgt_all[first]),
        )
    return [src_all[i] for i in kept], [tgt_all[i] for i in kept], kept


def translation_loss(
    model: Transformer,
    src: Tensor,
    tgt_in: Tensor,
    tgt_out: Tensor,
    *,
    objective: Objective | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """The summed loss of a batch of a :class:`~qkv.models.transformer.Transformer` under ``objective``.

    Args:
        model: the model.
        src, tgt_in, tgt_out: the batch's source ids, target ids shifted right, ids to predict.
        objective: a training objective (:mod:`qkv.training.objectives`), which holds its own
            smoothing; the default one (:class:`~qkv.training.objectives.LabelSmoothedCrossEntropy`)
            runs the model's own :meth:`~qkv.models.transformer.Transformer.loss`.
        label_smoothing: read only with no ``objective`` (a caller from before objectives): the
            default objective's ``eps``.

    Returns:
        The summed loss, a scalar.
    """
    if objective is None:  # a caller from before objectives
        return model.loss(src, tgt_in, tgt_out, label_smoothing=label_smoothing)
    if isinstance(objective, LabelSmoothedCrossEntropy):  # the default: the model's own loss, as with none
        return model.loss(src, tgt_in, tgt_out, label_smoothing=objective.label_smoothing)
    copies = objective.copies  # stacked: each copy draws its own dropout in the one pass
    hidden = model.hidden_states(stacked(src, copies), stacked(tgt_in, copies))
    return objective(Predictions(hidden, model.output_proj.weight, tgt_out, model.config.pad_id))


class PairStore(Protocol):
    """Tokenized training pairs: :class:`TokenLists` in memory, or a prepared folder's
    :class:`~qkv.data.prepared.PreparedSplit` read a batch at a time."""

    def __len__(self) -> int: ...

    def lengths(self) -> np.ndarray:
        """``(n, 2)`` the source and target lengths in tokens."""
        ...

    def read(self, indices: Iterable[int]) -> tuple[list[list[int]], list[list[int]]]:
        """The source and target ids of the pairs ``indices``."""
        ...

    def where(self, index: int) -> str:
        """Where pair ``index`` comes from (file:line), for messages."""
        ...


class TokenLists:
    """Tokenized pairs in memory: the counterpart of :class:`~qkv.data.prepared.PreparedSplit`
    (``lengths()``, ``read(indices)``, ``where(index)``) for corpora that fit in memory."""

    def __init__(
        self,
        src_ids: list[list[int]],
        tgt_ids: list[list[int]],
        lines: list[int] | None = None,
        source: dict | None = None,
    ) -> None:
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.lines = lines if lines is not None else list(range(1, len(src_ids) + 1))
        self.source = source or {}

    def __len__(self) -> int:
        return len(self.src_ids)

    def lengths(self) -> np.ndarray:
        """``(n, 2)`` the source and target lengths in tokens, int64."""
        return np.array([[len(s), len(t)] for s, t in zip(self.src_ids, self.tgt_ids)], dtype=np.int64).reshape(-1, 2)

    def read(self, indices: Iterable[int]) -> tuple[list[list[int]], list[list[int]]]:
        """The source and target ids of the pairs ``indices``, in that order (the lists held, not copies)."""
        return [self.src_ids[i] for i in indices], [self.tgt_ids[i] for i in indices]

    def where(self, index: int) -> str:
        """Where pair ``index`` comes from, for messages: ``src_file:line / tgt_file:line``
        (``source`` and ``target`` where the files are not known)."""
        line = self.lines[index]
        return f"{self.source.get('src') or 'source'}:{line} / {self.source.get('tgt') or 'target'}:{line}"


class TranslationTask:
    """Parallel text for an encoder-decoder :class:`~qkv.models.transformer.Transformer`.

    The training pairs are text (tokenised when the task is built, held in memory) or a split of a
    prepared folder (:class:`~qkv.data.prepared.PreparedSplit`: read a batch at a time, so a
    process holds O(batch) token data). Both give the same batches for the same ids and seed.
    Training pairs longer than ``max_len`` are left out (with a count and the first file:line);
    validation pairs that do not fit are left out of validation. ``both_directions``: the second half
    of the training pairs is the first half reversed (:func:`qkv.data.sources.both_directions`; what
    fits a model fits it either way round, so the halves stay equal), and
    :meth:`drop_reversed_pairs` can go on with the given direction alone.

    Raises:
        ValueError: no training pair fits the model.
    """

    loss_fn = staticmethod(translation_loss)

    def __init__(
        self,
        tokenizer: Tokenizer,
        train_data: ParallelText | PairStore,
        valid_data: ParallelText | None,
        *,
        max_len: int,
        pad_id: int,
        both_directions: bool = False,
    ) -> None:
        self.tokenizer, self.valid, self.max_len, self.pad_id = tokenizer, valid_data, max_len, pad_id
        self.both_directions = both_directions
        self.subword_dropout: SubwordDropout | None = None
        self.pairs: PairStore
        if isinstance(train_data, ParallelText):
            src_ids, tgt_ids, encoded = encode_pairs(tokenizer, train_data, max_len)
            self.pairs = TokenLists(
                src_ids, tgt_ids, [i + 1 for i in encoded], {"src": train_data.src_path, "tgt": train_data.tgt_path}
            )
        else:
            self.pairs = train_data
        lengths = self.pairs.lengths()
        # the padded length bucketing sorts by: the longer of source + EOS and BOS + target (kept in the
        # table's own small type: 2 bytes a pair; a sentence at the type's limit fits no model anyway)
        longest = np.maximum(lengths[:, 0], lengths[:, 1])
        del lengths
        if longest.dtype.kind == "u":
            np.minimum(longest, np.iinfo(longest.dtype).max - 1, out=longest)
        self.padded_lengths = longest + 1
        del longest
        fits = self.padded_lengths <= max_len
        kept = int(fits.sum())
        if not kept:
            raise ValueError(
                f"none of the {len(self.pairs)} training pairs fits the model's {max_len} positions; "
                "pass a larger --max-len"
            )
        self.kept = None if kept == len(fits) else np.flatnonzero(fits)
        if self.kept is not None:
            first = int(np.argmin(fits))
            logger.warning(
                "left out %d of %d training pairs longer than the model's %d positions (first: %s, %d "
                "tokens); pass a larger --max-len to keep them",
                len(fits) - kept,
                len(fits),
                max_len,
                self.pairs.where(first),
                int(self.padded_lengths[first]) - 1,
            )

    @property
    def num_examples(self) -> int:
        """The training pairs that go into batches: those that fit the model, less any that
        :meth:`keep_first` or :meth:`drop_reversed_pairs` left out."""
        return len(self.pairs) if self.kept is None else len(self.kept)

    def _in_memory(self) -> TokenLists:
        if not isinstance(self.pairs, TokenLists):
            raise TypeError("a prepared folder's pairs are read a batch at a time: no ids are held in memory")
        return self.pairs

    @property
    def src_ids(self) -> list[list[int]]:
        """The source ids of pairs held in memory (text given to the task)."""
        return self._in_memory().src_ids

    @property
    def tgt_ids(self) -> list[list[int]]:
        """The target ids of pairs held in memory (text given to the task); a prepared folder's
        pairs are not held, and raise ``TypeError``."""
        return self._in_memory().tgt_ids

    def _trained_indices(self) -> np.ndarray:
        """The indices of the pairs that go into batches."""
        return np.arange(len(self.pairs)) if self.kept is None else self.kept

    def keep_first(self, count: int) -> None:
        """Train on the first ``count`` pairs held (smoke tests; ``both_directions``: the first
        ``count`` each way): the rest stay loaded, in no batch."""
        indices = self._trained_indices()
        keep = indices < count
        if self.both_directions:
            half = len(self.pairs) // 2
            keep |= (indices >= half) & (indices < half + count)
        self.kept = indices[keep]

    def drop_reversed_pairs(self) -> None:
        """Train on the given direction alone from the next epoch's batches on: the first half of
        the pairs (``both_directions`` runs, whose second half is the first reversed)."""
        if not self.both_directions:
            raise ValueError("only a task built with both_directions holds reversed pairs to drop")
        if len(self.pairs) % 2:
            raise ValueError(f"{len(self.pairs)} training pairs cannot be pairs and the same pairs reversed")
        indices = self._trained_indices()
        self.kept = indices[indices < len(self.pairs) // 2]

    def batches(self, epoch: int, max_tokens: int, seed: int) -> BatchPlan:
        """The epoch's token-bucketed batches (example indices), shuffled by ``seed + epoch``; with
        subword dropout, bucketed by the lengths of the epoch's cut (so a batch's sentences stay alike
        in length and its padding small)."""
        lengths = self.padded_lengths if self.subword_dropout is None else self._cut_lengths(epoch)
        return bucket_batches(lengths, max_tokens, seed=seed + epoch, indices=self.kept)

    def _cut_lengths(self, epoch: int, chunk: int = 50_000) -> np.ndarray:
        """Padded lengths of the pairs as subword dropout cuts them in ``epoch`` (make_batch cuts them
        again the same way: the cut is a hash, not a random stream)."""
        dropout = self.subword_dropout
        if dropout is None:
            return self.padded_lengths
        lengths = self.padded_lengths.copy()
        indices = self._trained_indices()
        for start in range(0, len(indices), chunk):
            part = indices[start : start + chunk].tolist()
            src, tgt = dropout.split_pairs(*self.pairs.read(part), part, epoch=epoch)
            lengths[part] = [max(len(a), len(b)) + 1 for a, b in zip(src, tgt)]
        return lengths

    def set_subword_dropout(self, p: float, seed: int) -> None:
        """Split training tokens into their merge parts with probability ``p`` (0: off), afresh
        every epoch (:mod:`qkv.data.subword_dropout`)."""
        self.subword_dropout = SubwordDropout(self.tokenizer, p, seed, self.max_len - 1) if p else None

    def make_batch(self, indices: list[int], epoch: int = 0) -> Batch:
        """The padded batch of the training pairs ``indices`` (one of :meth:`batches`).

        Args:
            indices: the pairs' indices.
            epoch: with subword dropout, the epoch whose cut of the tokens to use (the one
                :meth:`batches` bucketed by); otherwise unused.

        Returns:
            A :class:`~qkv.data.batching.Batch`: the sources with EOS, the targets with BOS (in)
            and EOS (out), padded with ``pad_id``.
        """
        src, tgt = self.pairs.read(indices)
        if self.subword_dropout is not None:
            src, tgt = self.subword_dropout.split_pairs(src, tgt, indices, epoch=epoch)
        return make_batch(src, tgt, pad_id=self.pad_id, bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id)

    @staticmethod
    def loss(module: nn.Module, batch: Batch, objective: Objective) -> Tensor:
        """``module`` is the engine's wrapper that calls ``loss_fn`` (:func:`translation_loss`)."""
        return module(batch.src, batch.tgt_in, batch.tgt_out, **loss_keywords(objective))

    @torch.no_grad()
    def validate(self, model: Transformer, sentences: int, bf16: bool) -> dict | None:
        """Validation loss and greedy BLEU/chrF/exact match on the first ``sentences`` pairs that fit."""
        if self.valid is None:
            return None
        subset = ParallelText(
            self.valid.src[:sentences], self.valid.tgt[:sentences], self.valid.src_path, self.valid.tgt_path
        )
        src_ids, tgt_ids, kept = encode_pairs(self.tokenizer, subset, self.max_len, what="validation")
        if not kept:
            logger.warning("no validation pair fits the model's %d positions: validation skipped", self.max_len)
            return None
        src, refs = [subset.src[i] for i in kept], [subset.tgt[i] for i in kept]
        device = model_device(model)
        total_loss, total_tokens = 0.0, 0
        with autocast_context(device, bf16):
            for index in token_batches([len(x) + 1 for x in src_ids], [len(x) + 1 for x in tgt_ids], 4000, seed=None):
                batch = make_batch(
                    [src_ids[i] for i in index],
                    [tgt_ids[i] for i in index],
                    pad_id=self.pad_id,
                    bos_id=self.tokenizer.bos_id,
                    eos_id=self.tokenizer.eos_id,
                ).to(device)
                total_loss += float(translation_loss(model, batch.src, batch.tgt_in, batch.tgt_out))
                total_tokens += batch.num_tgt_tokens
        hyps = translate_texts(model, self.tokenizer, src, beam_size=1, bf16=bf16)
        scores = score_translations(hyps, refs)
        val_loss = total_loss / total_tokens
        return {
            "val_loss": round(val_loss, 4),
            "val_ppl": round(math.exp(min(val_loss, 700)), 3),
            "val_bleu_greedy": scores["bleu"],
            "val_chrf_greedy": scores["chrf"],
            "val_exact_match": round(exact_match(hyps, refs), 4),
            "sentences": len(kept),
            "score": scores["bleu"],
        }
