"""Which differences in Multi30k BLEU between finished runs are larger than chance: sacreBLEU's paired
bootstrap resampling and approximate randomization (qkv.metrics.significance.paired_significance) on the
translations the runs saved, every run against the first.

A run is ``NAME=PATH``: PATH is a run folder of benchmarks/train_multi30k.py (or of
train_multi30k_ensemble.py), whose ``<split>.hyp.<tgt>`` holds its beam-5 translations of the split,
or such a file itself. Validation BLEU is what issue 18's settings are chosen on; this says how much
of a difference between two settings one validation set of 1,014 sentences can tell from noise.
Seconds of CPU, no decoding.

    python benchmarks/significance.py --split val --run recipe=runs/multi30k-en-de \\
        --run "weight decay 0.1=runs/multi30k-en-de-wd01" \\
        --out benchmarks/results/multi30k/significance/val_significance.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data import resolve_multi30k
from qkv.data.sources import load_split
from qkv.metrics.scores import read_translations
from qkv.metrics.significance import paired_significance, significance_lines

SPLITS = {"val": "val", "test_2016": "test"}  # the name in a hypothesis file -> load_split's name


def parse_run(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def translations_file(path: Path, split: str, tgt: str) -> Path:
    """PATH itself when it is a file, else the run folder's ``<split>.hyp.<tgt>``."""
    if path.is_dir():
        path = path / f"{split}.hyp.{tgt}"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a finished benchmarks/train_multi30k.py run saves it)")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run",
        action="append",
        type=parse_run,
        required=True,
        metavar="NAME=PATH",
        help="a run folder or a translations file; the first is the baseline (give two or more)",
    )
    p.add_argument("--split", choices=tuple(SPLITS), default="val")
    p.add_argument(
        "--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache, as qkv train finds it)"
    )
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--resamples", type=int, default=1000, help="paired bootstrap resamples (default 1000)")
    p.add_argument("--trials", type=int, default=10000, help="approximate randomization trials (default 10000)")
    p.add_argument("--note", default=None, help="a remark stored in the JSON (e.g. where the runs trained)")
    add_result_options(p, required=True)
    args = p.parse_args(argv)
    if len(args.run) < 2:
        p.error("give a baseline and at least one other --run")
    names = [name for name, _ in args.run]
    if len(set(names)) != len(names):
        p.error(f"each --run needs its own NAME, got {names}")
    if args.resamples < 100 or args.trials < 100:
        p.error("--resamples and --trials: at least 100 each")
    try:
        out = check_result_file(p, args)
        files = {name: translations_file(Path(path), args.split, args.tgt) for name, path in args.run}  # before data
        folder = str(resolve_multi30k(args.data))  # --data, $QKV_DATA/multi30k or the cache
        spec = {"source": "multi30k", "src_lang": args.src, "tgt_lang": args.tgt, "folder": folder}
        references = load_split(spec, SPLITS[args.split]).tgt
        results = paired_significance(
            {name: read_translations(f) for name, f in files.items()},
            references,
            resamples=args.resamples,
            trials=args.trials,
        )
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = {
        "what": f"Multi30k {args.src}->{args.tgt} {args.split}: sacreBLEU of each run's saved translations, "
        "its paired-bootstrap mean and 95% interval (mean +- ci95), and two-sided p-values against "
        f"the first run (paired bootstrap, {args.resamples} resamples; approximate randomization, "
        f"{args.trials} trials)",
        "command": " ".join(["python"] + sys.argv),
        "sentences": len(references),
        "translations": {name: str(f) for name, f in files.items()},
        "results": results,
    }
    if args.note:
        report["note"] = args.note
    report["machine"] = environment()
    write_result(out, report)
    for line in significance_lines(results):
        print(line)
    print(json.dumps({"wrote": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
