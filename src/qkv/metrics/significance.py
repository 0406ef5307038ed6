"""Paired significance between systems on the same sentences (sacreBLEU's paired bootstrap
resampling), and its report lines.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import sacrebleu
from sacrebleu.significance import PairedTest, Result

logger = logging.getLogger(__name__)


def paired_significance(
    systems: dict[str, list[str]],
    references: list[str],
    *,
    resamples: int = 1000,
    trials: int = 10000,
    seed: int = 12345,
) -> dict[str, dict]:
    """How far apart corpus BLEU scores on one test set are from chance, every system against the
    first (the baseline), by sacreBLEU's two paired tests (sacrebleu.significance): paired bootstrap
    resampling (Koehn 2004; ``resamples`` resamples of the sentences, giving each score's bootstrap mean
    and 95% confidence interval) and approximate randomization (Riezler and Maxwell 2005; ``trials``
    random swaps of the two systems' sentences). Both are two-sided: the chance of a difference at least
    this large, either way, were the two systems the same; the baseline has none.

    sacreBLEU counts only the resampled differences strictly larger than the observed one, so where
    only a few sentences differ from the baseline's, every random swap reproduces the observed
    difference and approximate randomization reports a small p for a tiny difference: ``differing``
    says how many sentences differ, and a system identical to the baseline gets p = 1 from both tests
    (no difference at all) rather than sacreBLEU's 1 / (trials + 1).

    Returns ``{name: {"bleu", "bootstrap_mean", "ci95", "p_bootstrap", "p_randomization", "differing"}}``
    (ci95 is the half-width: the interval is mean +- ci95; the baseline's p-values and ``differing``
    are None).
    """
    if len(systems) < 2:
        raise ValueError("need a baseline and at least one system to compare with it")
    for name, hyps in systems.items():
        if len(hyps) != len(references):
            raise ValueError(f"{name}: {len(hyps)} translations for {len(references)} references")
    named: list[tuple[str, Sequence[str]]] = list(systems.items())
    saved = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)  # sacreBLEU reads its seed from here
    try:
        _, bootstrap = PairedTest(
            named, {"BLEU": sacrebleu.BLEU()}, [references], test_type="bs", n_samples=resamples
        )()
        _, randomization = PairedTest(
            named, {"BLEU": sacrebleu.BLEU()}, [references], test_type="ar", n_samples=trials
        )()
    finally:
        if saved is None:
            os.environ.pop("SACREBLEU_SEED", None)
        else:
            os.environ["SACREBLEU_SEED"] = saved
    out = {}
    baseline = named[0][1]
    for i, ((name, texts), bs, ar) in enumerate(
        zip(named, _results(bootstrap["BLEU"]), _results(randomization["BLEU"]))
    ):
        differing = None if i == 0 else sum(a != b for a, b in zip(texts, baseline))
        out[name] = {
            "bleu": round(float(bs.score), 2),
            "bootstrap_mean": round(_figure(bs.mean), 2),
            "ci95": round(_figure(bs.ci), 2),
            "p_bootstrap": None if i == 0 else 1.0 if differing == 0 else round(_figure(bs.p_value), 4),
            "p_randomization": None if i == 0 else 1.0 if differing == 0 else round(_figure(ar.p_value), 4),
            "differing": differing,
        }
    return out


def _results(column: list[str | Result]) -> list[Result]:
    """sacreBLEU's column of one metric: one :class:`Result` per system, in the systems' order."""
    results = [item for item in column if isinstance(item, Result)]
    if len(results) != len(column):
        raise ValueError(f"sacreBLEU's paired test gave {column!r}, not one result per system")
    return results


def _figure(value: float | None) -> float:
    """A figure sacreBLEU's paired test fills in (only a baseline's p-value is None, and it is not read)."""
    if value is None:
        raise ValueError("sacreBLEU's paired test left a figure out")
    return float(value)


def significance_lines(results: dict[str, dict]) -> list[str]:
    """:func:`paired_significance`'s results as lines to print: each system's BLEU and 95% interval,
    and after the baseline (the first) its difference from it with both p-values, then the name."""
    baseline = next(iter(results.values()))["bleu"]
    lines = []
    for name, r in results.items():
        low, high = r["bootstrap_mean"] - r["ci95"], r["bootstrap_mean"] + r["ci95"]
        line = f"BLEU {r['bleu']:6.2f}  95% {low:6.2f}-{high:<6.2f}"
        if r["p_bootstrap"] is None:
            line += f"  {'(baseline)':>61s}"
        else:
            line += (
                f"  {r['bleu'] - baseline:+6.2f}  p {r['p_bootstrap']:.3f} (bootstrap) "
                f"{r['p_randomization']:.3f} (randomization)  {r['differing']:5d} differ"
            )
        lines.append(f"{line}  {name}")
    return lines
