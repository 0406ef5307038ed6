"""A translation run's pairs on disk: the run's own prepared copy of them, written with the run
folder when it starts from text (:func:`write_run_data`), and the task a resume opens again
(:func:`open_translation_task`): from that copy, or from the prepared folder the run started on,
refused when the data changed since (another fingerprint, or files that are not what the
manifest says)."""

from __future__ import annotations

import logging
from pathlib import Path

from qkv.data.parallel import ParallelText
from qkv.data.prepared import PreparedCorpus, PreparedSplit
from qkv.data.prepared_writer import write_token_lists
from qkv.data.sources import both_directions, data_fingerprint, load_train_valid
from qkv.data.spec import DataSpec
from qkv.data.tokenizer import Tokenizer
from qkv.models.transformer import TransformerConfig
from qkv.training import TranslationTask
from qkv.training.tasks import TokenLists

logger = logging.getLogger(__name__)

RUN_DATA_FOLDER = "data"
RESUME_REMEDY = "resuming would not continue the same run; restore the folder or start a new --run-dir"


def write_run_data(
    folder: Path, tokenizer: Tokenizer, pairs: TokenLists, valid: ParallelText | None, data: DataSpec
) -> dict:
    """The training pairs a run starts with (already tokenised, over-long ones left out) and its
    validation pairs, as a prepared folder inside the run folder. Returns its manifest."""
    folder.mkdir()
    splits = {"train": (pairs.src_ids, pairs.tgt_ids, pairs.lines)}
    sources = {"train": pairs.source}
    if valid is not None:
        splits["valid"] = (
            tokenizer.encode_batch(valid.src),
            tokenizer.encode_batch(valid.tgt),
            list(range(1, len(valid) + 1)),
        )
        sources["valid"] = {"src": valid.src_path, "tgt": valid.tgt_path}
    return write_token_lists(folder, tokenizer, splits, sources=sources, data=data.to_json())


def open_translation_task(
    run_dir: Path, config: dict, tokenizer: Tokenizer, model_config: TransformerConfig
) -> TranslationTask:
    """The task of a translation run: from its prepared folder (its own copy, or the one it was
    started with, refused if it changed since: another fingerprint, or files that are not what the
    manifest says), or for runs older than prepared folders from its text, refused if that changed."""
    try:
        spec = DataSpec.from_json(config.get("data"))
    except ValueError as err:
        raise ValueError(f"{run_dir / 'config.json'}: data: {err}") from None
    prepared, saved_print = config.get("prepared"), config.get("data_fingerprint")
    if prepared and spec.source != "prepared":
        _check_source_unchanged(spec, saved_print)
    if prepared:
        corpus = PreparedCorpus(run_dir / prepared["folder"])  # an absolute folder stays itself
        if prepared.get("fingerprint") and corpus.fingerprint != prepared["fingerprint"]:
            raise ValueError(
                f"the prepared folder {corpus.folder} changed since this run started (fingerprint "
                f"{corpus.fingerprint[:12]}, the run's {prepared['fingerprint'][:12]}): resuming would not "
                "continue the same run; restore it or start a new --run-dir"
            )
        # every file hashed from its contents: a kept hash (verified.json) is no proof that the
        # bytes are those the run started on. The run's own copy keeps no hash cache: nothing is
        # written into a run folder by opening it
        vocab = min(model_config.src_vocab_size, model_config.tgt_vocab_size)
        corpus.verify(vocab, cache=spec.source == "prepared", trust_cache=False, remedy=RESUME_REMEDY)
        train: ParallelText | PreparedSplit = corpus.split("train")
        valid = corpus.text("valid", tokenizer) if corpus.has("valid") else None
    else:
        train, valid = load_train_valid(spec)
        _compare_fingerprint(saved_print, train)
        if spec.both_directions:
            train = both_directions(train)
    # the run's own copy holds the pairs both ways round already
    return TranslationTask(
        tokenizer,
        train,
        valid,
        max_len=model_config.max_len,
        pad_id=model_config.pad_id,
        both_directions=spec.both_directions,
    )


def _check_source_unchanged(spec: DataSpec, saved_print: dict | None) -> None:
    """A run that keeps its own copy of its pairs still refuses to resume when the text it was
    started from changed (the user most likely meant to train on the new text); when that text is
    gone, the copy is all the run needs."""
    try:
        train_data, _ = load_train_valid(spec)
    except FileNotFoundError as error:
        logger.info("%s; resuming from the run's own copy of its training pairs", error)
        return
    _compare_fingerprint(saved_print, train_data)


def _compare_fingerprint(saved_print: dict | None, train_data: ParallelText) -> None:
    now = data_fingerprint(train_data)
    if saved_print and saved_print != now:
        raise ValueError(
            f"the training data changed since this run started ({saved_print['pairs']} pairs, now "
            f"{now['pairs']}{'' if saved_print['pairs'] != now['pairs'] else ', different text'}): "
            "resuming would not continue the same run; restore the data or start a new --run-dir"
        )
