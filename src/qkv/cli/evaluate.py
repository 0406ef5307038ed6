"""``qkv evaluate``: score a run folder.

    qkv evaluate runs/en-de --split test            # Multi30k test 2016, the recipe's beam and alpha
    qkv evaluate runs/mine --src test.en --ref test.de --beam 5
    qkv evaluate runs/wmt --src newstest2014.en --ref newstest2014.de   # --recipe paper-base: beam 4, alpha 0.6
    qkv evaluate runs/dates --split test            # also prints exact-match accuracy
    qkv evaluate runs/en-de --ensemble runs/en-de-seed1   # two runs decoding as one (qkv.decoding.ensemble)
    qkv evaluate runs/en-de --split val --against runs/en-de-wd   # is the difference larger than chance?
    qkv evaluate runs/en-de --engine ctranslate2 --quantization int8   # decoded by CTranslate2
    qkv evaluate runs/shakespeare                   # a language model: its validation and test splits
    qkv evaluate runs/shakespeare --split test      # ... one of them
    qkv evaluate runs/shakespeare --text other.txt  # ... or any UTF-8 text

Translation: sacreBLEU BLEU (cased, detokenised, 13a) and chrF, printed with their signatures;
then, labelled, BLEU in the papers' form (lowercased, Moses-normalised and Moses-tokenized, as
Multi30k papers report) and for a German target tokenized BLEU with compound splitting (the
Transformer paper's WMT En-De metric), see :mod:`qkv.metrics.bleu_forms`. The target language comes from
--tgt-lang, else the run's Multi30k pair, else the reference file's name (``newstest2014.de``).
With ``--against OTHER`` (a run folder, decoded here, or a file of its translations): each other
system's BLEU beside this run's, with two-sided p-values from sacreBLEU's paired bootstrap and
approximate randomization (:func:`qkv.metrics.significance.paired_significance`): whether a difference is
larger than what the choice of test sentences alone would give.
``--engine ctranslate2`` decodes with CTranslate2 (as ``qkv translate``; an export as RUN_DIR needs
--src/--ref, it keeps no data splits); beam search then divides by ``len ** alpha``, the power form.
A language model: the loss in nats per token, perplexity and bits per character over the
non-overlapping windows of the model's context in each split scored: by default validation, then
test (the split training never read; see :mod:`qkv.data.text`), ``--split val|test`` for one, or
``--text FILE``. ``--json`` prints one JSON object a line, one per split scored, each naming it
(``"split": "val"``, ``"test"`` or ``"text"``). A run without a test split (trained with
``--val-text`` and no ``--test-text``, or a run folder made before qkv kept one) reports validation
alone with a note on stderr, and ``--split test`` on it is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qkv.cli.evaluate_against import check_against, compare, print_comparison, read_against
from qkv.cli.options import (
    MAX_BEAM,
    add_engine_options,
    add_ensemble_option,
    beam_size,
    check_engine,
    ct2_translator,
    decode_config,
    length_penalty,
    non_negative_int,
    positive_int,
    set_threads,
)

if TYPE_CHECKING:
    from qkv.inference.decode import DecodeConfig
    from qkv.models.causal_lm import CausalLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv evaluate``'s flags: the run folder, what to score (``--split``, ``--src`` and
    ``--ref``, ``--text``), the decoding (``--beam``, ``--alpha``, ``--weights``, ``--bf16``, the
    ensemble and engine options), ``--limit``, ``--hyp-out``, ``--json``, ``--against``,
    ``--threads`` and ``--device``.

    Args:
        parser: the ``evaluate`` subcommand's parser, to add the flags to.
    """
    parser.add_argument("run_dir", help="a run folder made by qkv train")
    parser.add_argument(
        "--split",
        default=None,
        help="a split of the run's data: Multi30k train/val/test (test 2016) or a later test set "
        "(test_2017_flickr, test_2017_mscoco, test_2018_flickr: fetched into the cache when "
        "missing), dates val/test, files val, a language model val/test (default: test, or "
        "val for files; a language model: val then test)",
    )
    parser.add_argument("--src", help="score this source file instead of a split (needs --ref)")
    parser.add_argument("--ref", help="reference translations of --src, line-aligned")
    parser.add_argument(
        "--tgt-lang",
        help="the references' language, for the Moses rules of the papers' BLEU forms "
        "(default: the run's Multi30k target, else the reference file's "
        "extension, e.g. de for newstest2014.de)",
    )
    parser.add_argument("--text", help="a language model: score this UTF-8 text instead of the run's splits")
    parser.add_argument(
        "--beam",
        type=beam_size,
        default=None,
        help=f"beam size, 1 to {MAX_BEAM} (1 = greedy; default: the run's recipe's, else 5)",
    )
    parser.add_argument(
        "--alpha",
        type=length_penalty,
        default=None,
        help="length penalty exponent, 0 to 10 (default: the run's recipe's, else 0.6)",
    )
    parser.add_argument("--weights", choices=["model", "best", "last", "ema"], default="model")
    parser.add_argument(
        "--limit",
        type=non_negative_int,
        default=0,
        help="score only the first N sentences (a language model: windows) (0 = all)",
    )
    parser.add_argument("--hyp-out", help="also write the translations to this file")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the scores as one JSON object (a language model: one a line per split scored, each with its split)",
    )
    parser.add_argument("--bf16", action="store_true", help="decode under bfloat16 autocast")
    add_ensemble_option(parser)
    add_engine_options(parser)
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="RUN_OR_FILE",
        help="compare with another translation run (decoded here on the same sentences, with "
        "its own recipe's beam and alpha unless --beam/--alpha are given) or a file of "
        "translations, one per line (with --limit N: its first N lines): paired bootstrap "
        "and approximate randomization p-values for each BLEU difference (repeatable)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads (default: all cores; CTranslate2: its own default)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    """Run ``qkv evaluate``: score a translation run (sacreBLEU BLEU and chrF, the papers' BLEU
    forms, with ``--against`` the significance of each difference) or a language model (loss,
    perplexity and bits per character of each split scored), and print the scores.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the scores are printed. Options that do not fit together or do not
        fit the run's kind (``--src`` without ``--ref``, ``--text`` for a translation run,
        ``--against`` for a language model, ...) raise ``ValueError``, which the CLI reports as
        exit code 2.
    """
    from qkv.inference.kinds import SEQ2SEQ, model_kind
    from qkv.inference.runs import load_run, load_translator, read_run_config
    from qkv.metrics.bleu_forms import check_lang
    from qkv.runtime.device import pick_device
    from qkv.runtime.fileio import check_output_file

    if bool(args.src) != bool(args.ref):
        raise ValueError("give both --src and --ref, or a --split")
    if args.src and args.split:
        raise ValueError("give either --split or --src/--ref, not both")
    if args.tgt_lang is not None:
        check_lang(args.tgt_lang, "--tgt-lang")
    if args.hyp_out:
        check_output_file(args.hyp_out, "--hyp-out")
    check_engine(args)
    others = check_against(args)
    set_threads(args.threads)
    device = pick_device(args.device)
    if args.engine == "ctranslate2":
        exported = (Path(args.run_dir) / "qkv_ct2.json").is_file()
        if exported and not args.src:
            raise ValueError(f"{args.run_dir}: a CTranslate2 export keeps no data splits: give --src and --ref")
        if args.text:
            raise ValueError("--text scores a language-model run; CTranslate2 decodes translation runs")
        config = {} if exported else read_run_config(args.run_dir)
        if (kind := model_kind(config)) is not SEQ2SEQ:
            raise ValueError(f"{args.run_dir}: {kind.run_words}; --engine ctranslate2 decodes translation runs")
        with ct2_translator(args, device) as translator:
            config = {"decode": translator.manifest["decode"]} if exported else config
            engine = {"compute_type": translator.translator.compute_type}
            return _evaluate_translation(args, config, others, device, translator.translate, engine=engine)
    # a Transformer (an Ensemble of them with --ensemble) or a CausalLM, as the run's task says
    model: Any
    tokenizer: Any
    if args.ensemble:
        model, tokenizer, config = load_translator([args.run_dir, *args.ensemble], args.weights)
    else:
        model, tokenizer, config = load_run(args.run_dir, args.weights)
    model.to(device)
    if model_kind(config) is not SEQ2SEQ:
        if others:
            raise ValueError("--against compares translation runs; a language-model run has no BLEU")
        return _evaluate_language_model(args, model, tokenizer, config)
    if args.text:
        raise ValueError("--text is for a language-model run; a translation run takes --src and --ref")
    held = {"model": model}  # dropped before --against decodes its runs: one model in memory at a time
    del model
    return _evaluate_translation(
        args, config, others, device, partial(_qkv_translate, held, tokenizer, args, config), release=held.clear
    )


def _qkv_translate(
    held: dict, tokenizer: Any, args: argparse.Namespace, config: dict, src: list[str], decode: DecodeConfig
) -> list[str]:
    from qkv.inference.engines import QkvTranslator

    translator = QkvTranslator(held["model"], tokenizer, config=config, bf16=args.bf16, progress=sys.stderr.isatty())
    return translator.translate(src, decode)


def _evaluate_translation(
    args: argparse.Namespace,
    config: dict,
    others: list[str],
    device: Any,
    translate: Callable[[list[str], DecodeConfig], list[str]],
    release: Callable[[], None] | None = None,
    engine: dict | None = None,
) -> int:
    """Score a translation run's (or export's) translations of the split or --src, decoded by ``translate``
    (sources, a :class:`~qkv.inference.decode.DecodeConfig`); ``release`` drops its model before --against decodes others;
    ``engine``: what the scores record of CTranslate2 (its compute type)."""
    from qkv.data.parallel import read_parallel
    from qkv.data.sources import load_split
    from qkv.metrics.scores import exact_match, score_translations
    from qkv.runtime.fileio import is_special_file, write_text

    if args.src:
        data, name = read_parallel(args.src, args.ref), f"{args.src} -> {args.ref}"
    else:
        spec = config.get("data") or {}
        split = args.split or ("val" if spec.get("source") == "files" else "test")
        data, name = load_split(spec, split), split
    src, refs = data.src, data.tgt
    if args.limit:
        src, refs = src[: args.limit], refs[: args.limit]
    against = read_against(args, others, config, len(src))
    target_lang = args.tgt_lang or target_language(config.get("data") or {}, args.ref)
    decode = decode_config(args, config)  # the flags over the run's (or export's) saved settings
    hyps = translate(src, decode)
    scores = score_translations(hyps, refs, target_lang=target_lang)
    scores.update(
        split=name,
        sentences=len(src),
        beam=decode.beam_size,
        alpha=decode.alpha,
        length_penalty_form=decode.penalty,
        engine=args.engine,
        weights=args.weights,
        bf16=args.bf16,
        target_lang=target_lang,
        exact_match=round(exact_match(hyps, refs), 4),
    )
    scores.update(engine or {})
    if args.ensemble:
        scores["ensemble"] = [args.run_dir, *args.ensemble]
    if others:
        if release is not None:
            release()
        scores["against"] = compare(args, against, hyps, src, refs, device, penalty=decode.penalty)
    if args.hyp_out:
        hyp_out = Path(args.hyp_out)  # a symbolic link to a file is followed; a FIFO or device is named as given
        write_text(hyp_out if is_special_file(hyp_out) else hyp_out.resolve(), "".join(h + "\n" for h in hyps))
    if args.json:
        print(json.dumps(scores))
    else:
        _print_scores(args, scores, config)
    return 0


def _print_scores(args: argparse.Namespace, scores: dict, config: dict) -> None:
    """A translation run's scores as lines of text (``--json`` prints ``scores`` as it is)."""
    members = f", an ensemble of {1 + len(args.ensemble)} runs" if args.ensemble else ""
    form = f" ({scores['length_penalty_form']} form)" if scores["beam"] > 1 else ""
    engine = f", CTranslate2 ({scores['compute_type']})" if args.engine == "ctranslate2" else ""
    print(
        f"{scores['split']}: {scores['sentences']} sentence{'' if scores['sentences'] == 1 else 's'}, "
        f"beam {scores['beam']}, alpha {scores['alpha']}{form}, "
        f"{args.weights} weights{members}{engine}"
    )
    print(f"BLEU {scores['bleu']:.2f}  ({scores['bleu_signature']})")
    print(f"     {scores['bleu_details']}")
    print(f"chrF {scores['chrf']:.2f}  ({scores['chrf_signature']})")
    for key in ("bleu_papers_form", "bleu_compound_split"):  # each labelled by its form
        if key in scores:
            print(f"BLEU {scores[key]['bleu']:.2f}  ({scores[key]['form']})")
    if scores["target_lang"] is None and (config.get("data") or {}).get("source") != "dates":
        print("(the papers' BLEU forms need the references' language: pass --tgt-lang)")
    print(f"exact match {100 * scores['exact_match']:.2f}%")
    if "against" in scores:
        print_comparison(scores["against"])


def target_language(spec: dict, ref: str | None) -> str | None:
    """The references' language: the run's Multi30k target for its own splits, else the extension
    of the reference file (``--ref``, or a files run's validation target), ``.gz`` aside; None when
    neither says (the date task, or a file named without a language)."""
    import re

    if ref is None and spec.get("source") == "multi30k":
        return spec.get("tgt_lang", "de")
    path = ref or (spec.get("val_tgt") if spec.get("source") == "files" else None)
    if not path:
        return None
    name = Path(path).name
    name = name[: -len(".gz")] if name.endswith(".gz") else name
    suffix = name.rpartition(".")[2] if "." in name else ""
    return suffix if re.fullmatch(r"[a-z]{2,3}", suffix) else None


LM_SPLIT_NAMES = {"val": "validation split", "test": "test split"}


def _evaluate_language_model(args: argparse.Namespace, model: CausalLM, tokenizer: Any, config: dict) -> int:
    """Score a language-model run on its validation and test splits (or ``--split``'s, or ``--text``)."""
    from qkv.data.text import read_text
    from qkv.runs.language_model import missing_test_split

    if args.src or args.ref:
        raise ValueError(
            "a language-model run is scored on its splits (--split val or test) or on --text FILE, not --src/--ref"
        )
    if args.text and args.split:
        raise ValueError("give either --split or --text, not both")
    if args.split not in (None, *LM_SPLIT_NAMES):
        raise ValueError(f"--split {args.split}: a language-model run has the splits val and test")
    missing = missing_test_split(config)
    if args.split == "test" and missing:
        raise ValueError(f"{args.run_dir}: {missing}: score --split val, or a text training never saw with --text FILE")
    if args.text:
        text = read_text(args.text)
        tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)  # unknown characters: one line
        jobs = [("text", args.text, tokens, len(text) / max(1, len(tokens)))]
    else:
        names = [args.split] if args.split else ["val"] + ([] if missing else ["test"])
        jobs = [(name, LM_SPLIT_NAMES[name], *_split_tokens(Path(args.run_dir), config, name)) for name in names]
    for split, name, tokens, chars_per_token in jobs:
        scores = _score_tokens(args, model, tokenizer, tokens, chars_per_token)
        scores = {"split": split, "text": name, **scores}
        if args.json:
            print(json.dumps(scores), flush=True)
        else:
            print(
                f"{name}: {scores['tokens']} tokens in {scores['windows']} windows of {scores['context']}, "
                f"{args.weights} weights"
            )
            print(
                f"loss {scores['loss']:.4f} nats/token  perplexity {scores['perplexity']:.3f}  "
                f"{scores['bits_per_char']:.4f} bits/char",
                flush=True,
            )
    if not args.text and not args.split and missing:
        print(f"note: {missing}; only the validation split is scored", file=sys.stderr)
    return 0


def _split_tokens(run_dir: Path, config: dict, name: str) -> tuple[np.ndarray, float]:
    """A split's token array (memory-mapped, checked against config.json's count) and its characters
    per token."""
    from qkv.data.text import read_tokens
    from qkv.inference.kinds import LM_SECTION
    from qkv.runs.language_model import SPLIT_FILES, check_lm_arrays

    check_lm_arrays(run_dir, config, names=(name,))
    lm = config.get(LM_SECTION, {})
    split = (lm.get("splits") or {}).get(name)
    chars_per_token = split["chars_per_token"] if split else lm.get("chars_per_token", 1.0)
    return read_tokens(run_dir / SPLIT_FILES[name], config["model"]["vocab_size"]), chars_per_token


def _score_tokens(
    args: argparse.Namespace, model: CausalLM, tokenizer: Any, tokens: np.ndarray, chars_per_token: float
) -> dict:
    from qkv.training.tasks import LanguageModelTask

    context = model.config.context
    task = LanguageModelTask(tokenizer, tokens, tokens, context=context, chars_per_token=chars_per_token)
    windows = (len(tokens) - 1) // context
    if args.limit:
        windows = min(windows, args.limit)
    figures = task.validate(model, windows, args.bf16)
    if figures is None:  # the task validates on the tokens it was given
        raise ValueError("no tokens to score")
    return {
        "tokens": windows * context,
        "windows": windows,
        "context": context,
        "weights": args.weights,
        "loss": figures["val_loss"],
        "perplexity": figures["val_ppl"],
        "bits_per_char": figures["val_bpc"],
    }
