"""``qkv evaluate``: translate a split (or files) with a run folder and score it with sacreBLEU.

    qkv evaluate runs/en-de --split test            # Multi30k test 2016, beam 5
    qkv evaluate runs/mine --src test.en --ref test.de --beam 5
    qkv evaluate runs/dates --split test            # also prints exact-match accuracy

Scores are sacreBLEU BLEU (cased, detokenised, 13a) and chrF, printed with their signatures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkv.cli.options import length_penalty, non_negative_int, positive_int, set_threads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run folder made by qkv train")
    parser.add_argument("--split", default=None,
                        help="a split of the run's data: Multi30k train/val/test (test 2016), dates val/test, "
                             "files val (default: test, or val for files)")
    parser.add_argument("--src", help="score this source file instead of a split (needs --ref)")
    parser.add_argument("--ref", help="reference translations of --src, line-aligned")
    parser.add_argument("--beam", type=positive_int, default=5, help="beam size (1 = greedy; default 5)")
    parser.add_argument("--alpha", type=length_penalty, default=0.6,
                        help="length penalty exponent, 0 to 10 (default 0.6)")
    parser.add_argument("--weights", choices=["model", "best", "last"], default="model")
    parser.add_argument("--limit", type=non_negative_int, default=0, help="score only the first N sentences (0 = all)")
    parser.add_argument("--hyp-out", help="also write the translations to this file")
    parser.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    parser.add_argument("--bf16", action="store_true", help="decode under bfloat16 autocast")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    from qkv.checkpoint import load_run
    from qkv.device import pick_device
    from qkv.fileio import check_output_file, write_text
    from qkv.data.parallel import read_parallel
    from qkv.data.sources import load_split
    from qkv.evaluation import exact_match, score_translations, translate_texts

    if bool(args.src) != bool(args.ref):
        raise ValueError("give both --src and --ref, or a --split")
    if args.src and args.split:
        raise ValueError("give either --split or --src/--ref, not both")
    if args.hyp_out:
        check_output_file(args.hyp_out, "--hyp-out")
    set_threads(args.threads)
    device = pick_device(args.device)
    model, tokenizer, config = load_run(args.run_dir, args.weights)
    model.to(device)
    if args.src:
        data, name = read_parallel(args.src, args.ref), f"{args.src} -> {args.ref}"
    else:
        spec = config.get("data") or {}
        split = args.split or ("val" if spec.get("source") == "files" else "test")
        data, name = load_split(spec, split), split
    src, refs = data.src, data.tgt
    if args.limit:
        src, refs = src[: args.limit], refs[: args.limit]
    hyps = translate_texts(model, tokenizer, src, beam_size=args.beam, alpha=args.alpha, bf16=args.bf16,
                           progress=sys.stderr.isatty())
    scores = score_translations(hyps, refs)
    scores.update(split=name, sentences=len(src), beam=args.beam, weights=args.weights,
                  exact_match=round(exact_match(hyps, refs), 4))
    if args.hyp_out:
        write_text(Path(args.hyp_out).resolve(), "".join(h + "\n" for h in hyps))
    if args.json:
        print(json.dumps(scores))
        return 0
    print(f"{name}: {len(src)} sentences, beam {args.beam}, {args.weights} weights")
    print(f"BLEU {scores['bleu']:.2f}  ({scores['bleu_signature']})")
    print(f"     {scores['bleu_details']}")
    print(f"chrF {scores['chrf']:.2f}  ({scores['chrf_signature']})")
    print(f"exact match {100 * scores['exact_match']:.2f}%")
    return 0
