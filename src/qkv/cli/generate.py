"""``qkv generate``: continue a prompt with a trained language model, streaming the text.

    qkv generate runs/shakespeare --prompt "ROMEO:" --max-new-tokens 500
    qkv generate runs/shakespeare --prompt "ROMEO:" --temperature 0           # greedy
    qkv generate runs/shakespeare --num-samples 3 --top-k 40 --seed 1 --stop $'\\n\\n'
    qkv generate path/to/gpt2 --prompt "Attention is" --top-p 0.9              # a GPT-2 folder
    qkv generate path/to/qwen2 --prompt "Attention is" --temperature 0  # a Llama, Mistral or Qwen2 folder
    qkv generate exported/gpt2 --prompt "ROMEO:" --temperature 0   # a folder qkv export --to hf wrote

With one sample the text is written to stdout as it is produced; several samples are generated
together (one batch) and printed one after another. A prompt longer than the model's context is
cropped from the left (said on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qkv.cli.options import MAX_SAMPLES, num_samples, positive_int, set_threads
from qkv.runtime.fileio import read_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv generate``'s flags: the model folder, ``--prompt``, the sampling
    (``--max-new-tokens``, ``--temperature``, ``--top-k``, ``--top-p``, ``--num-samples``,
    ``--seed``, ``--stop``), ``--weights``, ``--threads`` and ``--device``.

    Args:
        parser: the ``generate`` subcommand's parser, to add the flags to.
    """
    parser.add_argument(
        "model",
        help="a language-model run folder made by qkv train, or a GPT-2, Llama, Mistral or Qwen2 folder "
        "(qkv export --to hf writes one)",
    )
    parser.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=500, help="tokens to generate (default 500)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, help="sample within the nucleus of probability p, (0, 1]")
    parser.add_argument(
        "--num-samples",
        type=num_samples,
        default=1,
        help=f"samples to generate, together in one batch (default 1, at most {MAX_SAMPLES})",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one each time)")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop a sample at this text (repeatable); the stop text is not printed",
    )
    parser.add_argument(
        "--weights",
        choices=["model", "best", "last"],
        default="model",
        help="which weights of a run folder (default: model)",
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def open_language_model(path: str | Path, weights: str = "model") -> tuple[Any, Any]:
    """``(CausalLM in eval mode, tokenizer)`` from a qkv language-model run or a checkpoint folder
    :func:`qkv.load_pretrained` reads as a language model: GPT-2, Llama, Mistral or Qwen2 (one that
    ``qkv export --to hf`` wrote gets the run's tokenizer class back)."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: model folder not found")
    config = read_json(config_path) if config_path.is_file() else {}
    if isinstance(config, dict) and config.get("model_type") is not None:
        from qkv.models.causal_lm import CausalLM
        from qkv.models.transformer import Transformer
        from qkv.pretrained import load_pretrained

        pretrained = load_pretrained(folder)
        if not isinstance(pretrained, CausalLM):
            what = "translation model" if isinstance(pretrained, Transformer) else "encoder"
            raise ValueError(f"{folder}: a {config.get('model_type')} {what}, not a language model")
        return pretrained, pretrained.tokenizer
    from qkv.inference.kinds import CAUSAL_LM
    from qkv.inference.runs import load_run

    model, tokenizer, _ = load_run(folder, weights, task=CAUSAL_LM.name)
    return model, tokenizer


def run(args: argparse.Namespace) -> int:
    """Run ``qkv generate``: open the language model, continue ``--prompt`` and write the text to
    stdout (one sample as it is produced, several one after another).

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the samples are written. A prompt that gives no tokens, or a folder
        that is not a language model, raises, which the CLI reports as exit code 2.
    """
    import torch

    from qkv.inference.generation import SamplingConfig, generate_texts
    from qkv.runtime.device import pick_device

    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, tuple(args.stop))
    set_threads(args.threads)
    device = pick_device(args.device)
    model, tokenizer = open_language_model(args.model, args.weights)
    model.to(device)
    ids = tokenizer.encode(args.prompt)  # a character the vocabulary lacks: ValueError, one line
    if not ids:
        raise ValueError("the prompt gives no tokens: pass --prompt with at least one character")
    context = model.config.context
    if len(ids) > context:
        print(f"the prompt is {len(ids)} tokens; the model reads the last {context} (its context)", file=sys.stderr)
    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=device).manual_seed(args.seed)
    stream = args.num_samples == 1  # one sample is written as it grows; several one after another
    if stream:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    samples = generate_texts(
        model,
        tokenizer,
        ids,
        sampling,
        samples=args.num_samples,
        generator=generator,
        on_text=_write if stream else None,
    )
    if stream:
        sys.stdout.write("\n")
    else:
        for i, sample in enumerate(samples):
            sys.stdout.write(f"---------- sample {i + 1} ----------\n{args.prompt}{sample.text}\n")
    sys.stdout.flush()
    return 0


def _write(_row: int, text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
