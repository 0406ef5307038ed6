"""How long Multi30k's references are against their sources, split by split, and (with ``--run-dir``)
how long a finished benchmark run's translations are against the references.

A model learns the target/source length ratio of its training split. Where validation's references
are relatively longer than training's and test's shorter, a model is short on validation and nearer
the length on test, and a length penalty tuned on validation asks for more length than test wants.
Words are whitespace-separated (what the references' lengths mean to a reader; sacreBLEU's brevity
penalty counts its own tokens, close to these).

    python benchmarks/length_ratios.py --src en --tgt de --run-dir runs/bench-multi30k-en_de \\
        --out benchmarks/results/multi30k/multi30k_length_ratios.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data.sources import load_split
from qkv.metrics.scores import read_translations

SPLITS = (("train", "train"), ("val", "val"), ("test", "test_2016"))


def words(lines: list[str]) -> int:
    return sum(len(line.split()) for line in lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--data-dir", default=None, help="the Multi30k files (default: as qkv train finds them)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="a run of benchmarks/train_multi30k.py whose saved translations "
        "(val.hyp.<tgt>, test_2016.hyp.<tgt>) to measure too",
    )
    add_result_options(p, required=True)
    args = p.parse_args()
    check_result_file(p, args)  # before any work
    spec = {"source": "multi30k", "src_lang": args.src, "tgt_lang": args.tgt, "folder": args.data_dir}
    report = {"command": " ".join(["python"] + sys.argv), "pair": f"{args.src}-{args.tgt}", "splits": {}}
    for split, name in SPLITS:
        data = load_split(spec, split)
        row = {
            "sentences": len(data),
            f"{args.src}_words_per_sentence": round(words(data.src) / len(data), 3),
            f"{args.tgt}_words_per_sentence": round(words(data.tgt) / len(data), 3),
            "target_per_source_word": round(words(data.tgt) / words(data.src), 4),
        }
        if args.run_dir and split != "train":
            hyp_file = Path(args.run_dir) / f"{name}.hyp.{args.tgt}"
            if not hyp_file.is_file():
                raise SystemExit(f"{hyp_file}: no such file (a finished benchmarks/train_multi30k.py run saves it)")
            hyps = read_translations(hyp_file)
            if len(hyps) != len(data):
                raise SystemExit(f"{hyp_file}: {len(hyps)} lines for {len(data)} references")
            row["translation_per_reference_word"] = round(words(hyps) / words(data.tgt), 4)
            row["translation_per_source_word"] = round(words(hyps) / words(data.src), 4)
        report["splits"][name] = row
    train_ratio = report["splits"]["train"]["target_per_source_word"]
    for row in report["splits"].values():
        row["ratio_against_train"] = round(row["target_per_source_word"] / train_ratio, 4)
    if args.run_dir:
        report["run_dir"] = args.run_dir
    report["machine"] = environment()
    write_result(args.out, report)
    print(json.dumps(report["splits"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
