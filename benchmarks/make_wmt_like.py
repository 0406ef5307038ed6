"""Write a generated parallel corpus with WMT 2014 English-German-like statistics, for the scale
test (benchmarks/paper_scale.py). Not a translation task: the point is the size and the shape.

- sentence lengths: lognormal words per source sentence (mean ~24, as WMT 2014 En-De's English
  side; a long tail capped at --max-words), the target's length the source's times a lognormal
  ratio (German sentences run a little shorter in words, longer in characters);
- words: each language has its own generated vocabulary of --vocab words (pronounceable letter
  strings, German nouns capitalised), drawn with Zipf-Mandelbrot frequencies (rank r weighted
  1 / (r + 2.7)), a comma now and then and a full stop at the end;
- a few bad lines, as real crawled corpora have (--bad-every N: one pair in N is empty on one
  side, not UTF-8, or far too long), so the prepare step's reporting is exercised at scale.

    python benchmarks/make_wmt_like.py --pairs 4500000 --out /tmp/wmt_like   # train.en, train.de, valid.*

Deterministic for a --seed. Writes plain text (``--gzip`` for .gz). Each file is written under a
temporary name and renamed into place once whole (qkv.runtime.fileio), so a killed run never leaves a
truncated train.en that looks complete.
"""

from __future__ import annotations

import argparse
import gzip
import sys
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np

from qkv.runtime.fileio import TMP_SUFFIX, atomic_path

SYLLABLES = [c + v for c in "bdfghklmnprstvwz" for v in "aeiou"] + ["sch", "ei", "au", "ie", "th", "ch", "qu"]


def make_vocabulary(rng: np.random.Generator, size: int, *, capitalise_every: int = 0) -> np.ndarray:
    """``size`` distinct pronounceable words of 1-6 syllables; shorter words tend to get the
    frequent (low) ranks."""
    words: dict[str, None] = {}
    while len(words) < size:
        n = 4 * size
        syllables = 1 + np.minimum(
            5, rng.exponential(1.3, n).astype(np.int64) + (np.arange(n) > 200) + (np.arange(n) > 5000)
        )
        table = rng.integers(0, len(SYLLABLES), (n, 6)).tolist()
        for row, count in zip(table, syllables.tolist()):
            words.setdefault("".join(SYLLABLES[i] for i in row[:count]))
            if len(words) == size:
                break
    listed = list(words)
    if capitalise_every:
        listed = [w.capitalize() if i % capitalise_every == 3 else w for i, w in enumerate(listed)]
    return np.array(listed, dtype=object)


def zipf_cdf(size: int, shift: float = 2.7) -> np.ndarray:
    weights = 1.0 / (np.arange(size) + 1 + shift)
    return np.cumsum(weights) / weights.sum()


def sentences(rng, vocab, cdf, lengths) -> list[str]:
    """One sentence per entry of ``lengths`` (words), words drawn from the Zipfian ``cdf``."""
    ranks = np.searchsorted(cdf, rng.random(int(lengths.sum())))
    words = vocab[ranks]
    commas = rng.random(len(words)) < 0.06
    commas[np.cumsum(lengths) - 1] = False  # no comma before the full stop
    words[commas] = words[commas] + ","
    out, start = [], 0
    for n in lengths.tolist():
        out.append(" ".join(words[start : start + n]) + ".")
        start += n
    return out


def word_counts(rng, n, *, mean_words, sigma, max_words):
    mu = np.log(mean_words) - sigma**2 / 2  # a lognormal with this mean
    src = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, max_words).astype(np.int64)
    tgt = np.clip(np.rint(src * rng.lognormal(-0.05, 0.15, n)), 1, max_words).astype(np.int64)
    return src, tgt


def corpus_files(out: Path, name: str, use_gzip: bool) -> list[Path]:
    """The English and German files of split ``name`` in ``out``."""
    suffix = ".gz" if use_gzip else ""
    return [out / f"{name}.en{suffix}", out / f"{name}.de{suffix}"]


def _open_binary(path: Path, use_gzip: bool) -> BinaryIO:
    """``path`` opened for writing bytes, through gzip (its fastest level) when ``use_gzip``."""
    return gzip.open(path, "wb", compresslevel=1) if use_gzip else open(path, "wb")


def write_corpus(
    out: Path,
    name: str,
    pairs: int,
    *,
    seed: int,
    vocabularies: tuple[np.ndarray, np.ndarray],
    mean_words: float,
    sigma: float,
    max_words: int,
    bad_every: int,
    use_gzip: bool,
    chunk: int = 50_000,
) -> dict:
    rng = np.random.default_rng(seed)
    en_vocab, de_vocab = vocabularies
    cdf = zipf_cdf(len(en_vocab))
    paths = corpus_files(out, name, use_gzip)
    bad = {"empty": 0, "not_utf8": 0, "too_long": 0}
    words = 0
    # each file is written whole under a temporary name, then renamed onto its own (atomic_path)
    with (
        atomic_path(paths[0]) as en_tmp,
        atomic_path(paths[1]) as de_tmp,
        _open_binary(en_tmp, use_gzip) as en_file,
        _open_binary(de_tmp, use_gzip) as de_file,
    ):
        for start in range(0, pairs, chunk):
            n = min(chunk, pairs - start)
            src_len, tgt_len = word_counts(rng, n, mean_words=mean_words, sigma=sigma, max_words=max_words)
            words += int(src_len.sum())
            en, de = sentences(rng, en_vocab, cdf, src_len), sentences(rng, de_vocab, cdf, tgt_len)
            en_bytes, de_bytes = [s.encode() for s in en], [s.encode() for s in de]
            if bad_every:
                for i in np.flatnonzero(rng.random(n) < 1.0 / bad_every).tolist():
                    kind = ("empty", "not_utf8", "too_long")[i % 3]
                    bad[kind] += 1
                    if kind == "empty":
                        de_bytes[i] = b""
                    elif kind == "not_utf8":
                        en_bytes[i] = en_bytes[i] + b" caf\xe9"  # Latin-1, not UTF-8
                    else:
                        en_bytes[i] = b" ".join([en_bytes[i]] * 40)
            en_file.write(b"\n".join(en_bytes) + b"\n")
            de_file.write(b"\n".join(de_bytes) + b"\n")
    return {
        "files": [str(p) for p in paths],
        "pairs": pairs,
        "mean_source_words": round(words / max(1, pairs), 2),
        "bad_pairs_written": bad,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=500_000, help="training pairs (WMT 2014 En-De: 4.5M)")
    parser.add_argument("--valid-pairs", type=int, default=3000, help="validation pairs (newstest2013: 3,000)")
    parser.add_argument("--out", default="/tmp/wmt_like", help="output folder")
    parser.add_argument("--vocab", type=int, default=200_000, help="distinct words per language")
    parser.add_argument("--mean-words", type=float, default=24.0, help="mean words per source sentence")
    parser.add_argument("--sigma", type=float, default=0.55, help="lognormal sigma of the sentence length")
    parser.add_argument("--max-words", type=int, default=250, help="longest sentence in words")
    parser.add_argument("--bad-every", type=int, default=20_000, help="one bad pair in N (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gzip", action="store_true", help="write .gz files")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace train.* / valid.* files already in --out (refused otherwise: they may be a real corpus)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    taken = [str(path) for name in ("train", "valid") for path in corpus_files(out, name, args.gzip) if path.exists()]
    if taken and not args.overwrite:  # before writing anything
        parser.error(f"{', '.join(taken)} exist: pass --overwrite to replace them, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("train", "valid"):  # the temporary files of a killed earlier run (atomic_path's names)
        for path in corpus_files(out, name, args.gzip):
            for stale in out.glob(f".{path.name}.*{TMP_SUFFIX}"):
                stale.unlink(missing_ok=True)
    start = time.perf_counter()
    vocabularies = (
        make_vocabulary(np.random.default_rng([args.seed, 1]), args.vocab),
        make_vocabulary(np.random.default_rng([args.seed, 2]), args.vocab, capitalise_every=4),
    )
    common = dict(
        vocabularies=vocabularies,
        mean_words=args.mean_words,
        sigma=args.sigma,
        max_words=args.max_words,
        use_gzip=args.gzip,
    )
    train = write_corpus(out, "train", args.pairs, seed=args.seed, bad_every=args.bad_every, **common)
    valid = write_corpus(out, "valid", args.valid_pairs, seed=args.seed + 1, bad_every=0, **common)
    print(
        f"wrote {train['pairs']:,} training pairs ({train['mean_source_words']} words a source sentence on "
        f"average; bad pairs {train['bad_pairs_written']}) and {valid['pairs']:,} validation pairs into {out} "
        f"in {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
