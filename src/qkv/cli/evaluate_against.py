"""``qkv evaluate --against OTHER``: this run's translations beside other systems', with paired
significance tests (:func:`qkv.metrics.significance.paired_significance`). Each other system is a
run folder, decoded here, or a file of its translations; all are checked before anything is decoded."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from qkv.decoding.search import PenaltyForm


def check_against(args: argparse.Namespace) -> list[str]:
    """The --against paths, each named once and existing (checked before any model is loaded)."""
    seen = {str(Path(args.run_dir).resolve())}
    for path in args.against:
        resolved = Path(path).resolve()
        if not resolved.exists():
            raise FileNotFoundError(f"--against {path}: no such run folder or translations file")
        if str(resolved) in seen:
            raise ValueError(f"--against {path}: already compared (each run once, and not the run itself)")
        seen.add(str(resolved))
    return list(args.against)


def read_against(args: argparse.Namespace, others: list[str], config: dict, sentences: int) -> dict:
    """Each --against as what it holds, checked before anything is decoded: a translations file's lines
    (``sentences`` of them, the first ones under --limit), a run folder's config (a translation run of
    this run's language pair, where both name one)."""
    from qkv.metrics.scores import read_translations
    from qkv.runs.folder import read_run_config
    from qkv.runs.kinds import run_kind
    from qkv.runs.translation_kind import TRANSLATION

    held: dict[str, dict | list[str]] = {}
    for path in others:
        if Path(path).is_dir():
            other = read_run_config(path)
            if run_kind(other) is not TRANSLATION:
                raise ValueError(f"--against {path}: a language-model run, not a translation run")
            ours, theirs = direction(config), direction(other)
            if ours and theirs and ours != theirs:
                raise ValueError(f"--against {path}: it translates {'->'.join(theirs)}, this run {'->'.join(ours)}")
            held[path] = other
        else:
            translations = read_translations(path)
            if args.limit:
                translations = translations[: args.limit]
            if len(translations) != sentences:
                raise ValueError(
                    f"--against {path}: {len(translations)} translations for the {sentences} sentences "
                    "scored (one line each)"
                )
            held[path] = translations
    return held


def compare(
    args: argparse.Namespace,
    against: dict,
    hyps: list[str],
    src: list[str],
    refs: list[str],
    device: torch.device | str | None,
    penalty: PenaltyForm | None = None,
) -> dict:
    """This run's translations against each of ``against``'s (from :func:`read_against`): a run is
    decoded here on ``src`` (its own recipe's beam and alpha unless given, the length-penalty form this
    run is decoded with: ``penalty``, else ``--length-penalty-form``, else gnmt); then the paired tests."""
    from qkv.data.tokenizer import Tokenizer
    from qkv.inference.decode import DecodeConfig
    from qkv.inference.engines import QkvTranslator
    from qkv.inference.runs import load_run
    from qkv.metrics.significance import paired_significance
    from qkv.models.transformer import Transformer

    form = penalty or getattr(args, "length_penalty_form", None) or "gnmt"

    name = " + ".join([args.run_dir, *args.ensemble])
    systems = {name: hyps}
    for path, held in against.items():
        if isinstance(held, dict):  # a run's config
            model, tokenizer, _ = load_run(path, args.weights)
            if not isinstance(model, Transformer) or not isinstance(tokenizer, Tokenizer):
                raise ValueError(f"--against {path}: not a translation run")
            decode = DecodeConfig.of_run(held, beam_size=args.beam, alpha=args.alpha, penalty=form)
            translator = QkvTranslator(model.to(device), tokenizer, bf16=args.bf16, progress=sys.stderr.isatty())
            systems[path] = translator.translate(src, decode)
            del model, translator
        else:
            systems[path] = held
    resamples, trials = 1000, 10000
    return {
        "tests": f"two-sided, against {name}: paired bootstrap ({resamples} resamples; its mean and 95% "
        f"interval, mean +- ci95) and approximate randomization ({trials} trials)",
        "results": paired_significance(systems, refs, resamples=resamples, trials=trials),
    }


def direction(config: dict) -> tuple[str, str] | None:
    """A run's language pair when its data names one (Multi30k), else None."""
    spec = config.get("data") or {}
    return (spec["src_lang"], spec["tgt_lang"]) if spec.get("src_lang") and spec.get("tgt_lang") else None


def print_comparison(comparison: dict) -> None:
    """:func:`compare`'s results as lines of text."""
    from qkv.metrics.significance import significance_lines

    print(f"against the others ({comparison['tests']}):")
    for line in significance_lines(comparison["results"]):
        print(f"  {line}")
    print(
        "  (a difference is larger than chance at p < 0.05; the interval is the score's own spread over "
        "resampled sentences;\n   'differ': sentences translated otherwise than by the first, and where only a "
        "few differ the randomization p is too small to trust)"
    )
