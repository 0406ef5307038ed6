"""``qkv translate``: translate lines with a trained run folder.

echo "A man rides a bike." | qkv translate runs/en-de --beam 5
qkv translate runs/en-de sentences.en -o sentences.de
qkv translate runs/en-de sentences.en --ensemble runs/en-de-seed1   # two runs, probabilities averaged
qkv translate runs/en-de sentences.en --engine ctranslate2 --quantization int8   # decoded by CTranslate2

With ``--engine ctranslate2`` the run is converted into a temporary folder (the run is only read) or
RUN_DIR is a folder made by ``qkv export --to ctranslate2``; beam search then divides by ``len ** alpha``
(``--length-penalty-form power``), which ``--engine qkv --length-penalty-form power`` reproduces.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qkv.cli.options import (
    MAX_BEAM,
    add_engine_options,
    add_ensemble_option,
    beam_size,
    check_engine,
    ct2_translator,
    decode_config,
    length_penalty,
    positive_int,
    set_threads,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv translate``'s flags: the run folder, the input file and ``-o/--output``, the
    decoding (``--beam``, ``--alpha``, ``--weights``, ``--bf16``, the ensemble and engine options),
    ``--threads`` and ``--device``.

    Args:
        parser: the ``translate`` subcommand's parser, to add the flags to.
    """
    parser.add_argument(
        "run_dir", help="a run folder made by qkv train (with --engine ctranslate2 also a CTranslate2 export)"
    )
    parser.add_argument(
        "input", nargs="?", help="file with one sentence a line (.gz allowed; '-' or none: stdin), at most 1 MiB a line"
    )
    parser.add_argument(
        "-o", "--output", help="write the translations here ('-' or none: stdout; a FIFO or device is written in place)"
    )
    parser.add_argument(
        "--beam",
        type=beam_size,
        default=None,
        help=f"beam size, 1 to {MAX_BEAM} (1 = greedy; default: the run's recipe's, else 5)",
    )
    parser.add_argument(
        "--alpha",
        type=length_penalty,
        default=None,
        help="length penalty exponent, 0 to 10 (default: the run's recipe's, else 0.6)",
    )
    parser.add_argument(
        "--weights",
        choices=["model", "best", "last"],
        default="model",
        help="model = averaged final weights (default), best = best validation BLEU, last",
    )
    parser.add_argument("--bf16", action="store_true", help="decode under bfloat16 autocast")
    add_ensemble_option(parser)
    add_engine_options(parser)
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads (default: all cores; CTranslate2: its own default)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    """Run ``qkv translate``: translate each line of the input file (or stdin) with the run (with
    qkv, or CTranslate2 under ``--engine ctranslate2``) and write one translation a line to
    ``--output`` or stdout.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the translations are written. A bad output path, input file or
        engine option raises before any decoding, which the CLI reports as exit code 2.
    """
    from qkv.data.parallel import read_lines
    from qkv.inference.engines import QkvTranslator
    from qkv.inference.runs import load_translator
    from qkv.runtime.device import pick_device
    from qkv.runtime.fileio import check_output_file, is_special_file, write_text
    from qkv.runtime.textinput import read_input_lines

    output = None if args.output in (None, "-") else Path(args.output)
    if output is not None:  # checked before translating: a bad path must not cost the work
        check_output_file(output, "-o/--output")
    # a file is read before the model loads (a bad file costs nothing); standard input once it has
    # loaded, as before (a user typing sentences is told of a bad run folder first)
    from_file = read_lines(args.input) if args.input and args.input != "-" else None

    def read_input() -> list[str]:
        return from_file if from_file is not None else read_input_lines(None)  # stdin, a line at a time

    check_engine(args)
    set_threads(args.threads)
    device = pick_device(args.device)
    if args.engine == "ctranslate2":
        with ct2_translator(args, device) as ct2:
            decode = decode_config(args, {"decode": ct2.manifest["decode"]})
            outputs = ct2.translate(read_input(), decode)
    else:
        model, tokenizer, config = load_translator([args.run_dir, *args.ensemble], args.weights)
        decode = decode_config(args, config)  # the flags over the run's saved settings
        lines = read_input()
        progress = len(lines) > 100 and sys.stderr.isatty()
        translator = QkvTranslator(model.to(device), tokenizer, config=config, bf16=args.bf16, progress=progress)
        outputs = translator.translate(lines, decode)
    text = "".join(line + "\n" for line in outputs)
    if output is not None:  # a symbolic link to a file is followed; a FIFO or device is named as given
        write_text(output if is_special_file(output) else output.resolve(), text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0
