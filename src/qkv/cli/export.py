"""``qkv export``: a trained run in another format.

qkv export runs/multi30k --to hf hf-model/       # a MarianMTModel folder (transformers)
qkv export runs/shakespeare --to hf hf-lm/       # a GPT2LMHeadModel folder, or Llama/Mistral/Qwen2 by its shape
qkv export runs/multi30k --to onnx model.onnx    # ONNX (qkv.export.onnx)
qkv export runs/shakespeare --to onnx onnx-lm/   # one decoder-step graph with its cache (qkv.export.onnx_lm)
qkv export runs/multi30k --to ctranslate2 ct2/ --quantization int8   # CTranslate2 (qkv.export.ctranslate2)
qkv export runs/shakespeare --to ctranslate2 ct2-lm/   # a CTranslate2 Generator (qkv.export.ctranslate2_lm)

A model with no exact counterpart in the chosen format is refused with a one-line reason naming
the configuration field (exit code 2), never written as a different model. ``--overwrite`` replaces
only an earlier export of the same format (:mod:`qkv.export.output`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

FORMATS = ("hf", "onnx", "ctranslate2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv export``'s flags: the run folder and the output, the format ``--to``, which
    ``--weights``, ``--overwrite`` and CTranslate2's ``--quantization``.

    Args:
        parser: the ``export`` subcommand's parser, to add the flags to.
    """
    parser.add_argument("run", help="the run folder (made by qkv train)")
    parser.add_argument("out", help="the folder to write (created; see --overwrite)")
    parser.add_argument(
        "--to",
        required=True,
        choices=FORMATS,
        help="hf: a Hugging Face folder; onnx: ONNX; ctranslate2: a CTranslate2 folder",
    )
    parser.add_argument(
        "--weights",
        default="model",
        choices=("model", "best", "last", "ema"),
        help="which of the run's weights (default: model, the averaged/final ones)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier qkv export of the same format at OUT (one holding only the files its "
        ".qkv-export.json lists); never a run, a prepared folder or a folder qkv did not make",
    )
    parser.add_argument(
        "--quantization",
        default="float32",
        choices=("float32", "int8", "int8_float32", "int16", "float16", "bfloat16"),
        help="ctranslate2 only: the stored weight type (default float32, exact; int8: smaller and faster)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``qkv export``: write the run's chosen weights as a Hugging Face folder, an ONNX file or
    a CTranslate2 folder at ``out``.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the export is written. A missing run folder, ``--quantization``
        without ``--to ctranslate2``, a missing optional package or a model the format cannot hold
        exactly raise, and the CLI reports them as exit code 2.
    """
    run_dir = Path(args.run)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: run folder not found")
    if args.quantization != "float32" and args.to != "ctranslate2":
        raise ValueError(f"--quantization {args.quantization} applies to --to ctranslate2 only")
    if args.to == "hf":
        from transformers.utils import logging as hf_logging

        from qkv.export.huggingface import export_hf

        hf_logging.disable_progress_bar()  # one line of output, not a bar per file written
        out = export_hf(run_dir, args.out, weights=args.weights, overwrite=args.overwrite)
    elif args.to == "ctranslate2":
        try:
            import ctranslate2  # noqa: F401  (imported here only to name the missing package)

            from qkv.export.ctranslate2 import export_ctranslate2
            from qkv.export.ctranslate2_lm import export_ctranslate2_lm
        except ImportError as err:
            raise ValueError(f"CTranslate2 export needs ctranslate2: pip install 'qkv[deploy]' ({err})") from None
        from qkv.inference.kinds import CAUSAL_LM
        from qkv.inference.runs import read_run_config, run_task

        if run_task(read_run_config(run_dir)) == CAUSAL_LM.name:  # a decoder-only Generator folder
            export_ctranslate2 = export_ctranslate2_lm
        out = export_ctranslate2(
            run_dir, args.out, weights=args.weights, quantization=args.quantization, overwrite=args.overwrite
        )
    else:
        try:
            from qkv.export.onnx import export_onnx
        except ImportError as err:
            raise ValueError(
                f"ONNX export needs onnx, onnxscript and onnxruntime: pip install 'qkv[deploy]' ({err})"
            ) from None
        from qkv.export.onnx_lm import export_onnx_lm
        from qkv.inference.kinds import CAUSAL_LM
        from qkv.inference.runs import read_run_config, run_task

        if run_task(read_run_config(run_dir)) == CAUSAL_LM.name:  # one decoder-step graph with its cache
            export_onnx = export_onnx_lm
        out = export_onnx(run_dir, args.out, weights=args.weights, overwrite=args.overwrite)
    print(f"exported {run_dir} to {out}")
    return 0
