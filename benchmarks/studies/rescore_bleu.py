"""Score the translations a finished Multi30k benchmark run saved (``val.hyp.<tgt>``,
``test_2016.hyp.<tgt>``: beam 5, averaged weights) in every BLEU form, without decoding again:
sacreBLEU (which must equal the benchmark JSON's own figures, checked), the papers' form and, for
German, tokenized BLEU with compound splitting (qkv.metrics.bleu_forms). Minutes of CPU, not an hour.

    python benchmarks/studies/rescore_bleu.py --run-dir runs/bench-multi30k-en_de \\
        --benchmark benchmarks/results/multi30k/multi30k_en_de.json \
        --out benchmarks/results/multi30k/multi30k_en_de_papers_bleu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sacremoses

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data.sources import load_split
from qkv.metrics.scores import read_translations, score_translations
from qkv.runs.folder import read_run_config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="a run folder trained by benchmarks/train_multi30k.py")
    p.add_argument("--benchmark", required=True, help="the JSON that benchmark wrote for this run")
    add_result_options(p, required=True)
    args = p.parse_args()
    check_result_file(p, args)  # before any work
    run_dir = Path(args.run_dir)
    spec = read_run_config(run_dir)["data"]
    tgt = spec["tgt_lang"]
    benchmark = json.loads(Path(args.benchmark).read_text())
    if Path(benchmark["run_dir"]).resolve() != run_dir.resolve():
        raise SystemExit(f"{args.benchmark} describes {benchmark['run_dir']}, not {run_dir}")
    report = {
        "task": benchmark["task"],
        "command": " ".join(["python"] + sys.argv),
        "benchmark": args.benchmark,
        "run_dir": str(run_dir),
        "scores": {},
    }
    for split, name in (("val", "val"), ("test", "test_2016")):
        hyps = read_translations(run_dir / f"{name}.hyp.{tgt}")  # a translation may be empty
        scores = score_translations(hyps, load_split(spec, split).tgt, target_lang=tgt)
        published = benchmark["scores"]["averaged"][f"{name}_beam5"]["bleu"]
        if scores["bleu"] != published:  # the saved translations are not the ones the benchmark scored
            raise SystemExit(f"{name}: sacreBLEU {scores['bleu']} here, {published} in {args.benchmark}")
        report["scores"][f"{name}_beam5"] = scores
    report["machine"] = {**environment(), "sacremoses": sacremoses.__version__}
    write_result(args.out, report)
    print(
        json.dumps(
            {
                k: {
                    "sacrebleu": v["bleu"],
                    "papers_form": v["bleu_papers_form"]["bleu"],
                    "compound_split": v.get("bleu_compound_split", {}).get("bleu"),
                }
                for k, v in report["scores"].items()
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
