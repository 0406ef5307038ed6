"""Samples from a qkv language-model run and a nanoGPT checkpoint side by side (issue 55): the same
prompt, temperature, top-k, length and seed, both through qkv's ``CausalLM.generate`` (nanoGPT's
``ckpt.pt`` loaded by :mod:`qkv.pretrained.nanogpt`, its characters from the run's text, sorted as
nanoGPT's ``prepare.py`` sorts them). Writes the two texts to a small JSON.

    python benchmarks/lm_samples.py --run /tmp/lmvn2/qkv-10min --nanogpt-ckpt /tmp/lmvn2/nanogpt-10min \\
        --out benchmarks/results/language-model/lm_samples_10min_epyc_avx2.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.data.text import resolve_tinyshakespeare
from qkv.pretrained.nanogpt import load_nanogpt
from qkv.runs.folder import load_run


def sample(model: torch.nn.Module, encode: dict[str, int], chars: list[str], args: argparse.Namespace) -> str:
    ids = torch.tensor([[encode[c] for c in args.prompt]])
    generator = torch.Generator().manual_seed(args.seed)
    out = model.generate(ids, args.tokens, temperature=args.temperature, top_k=args.top_k, generator=generator)
    return args.prompt + "".join(chars[i] for i in out[0, ids.shape[1] :].tolist())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="a qkv language-model run folder (character level)")
    parser.add_argument("--nanogpt-ckpt", required=True, type=Path, help="nanoGPT's ckpt.pt or its folder")
    parser.add_argument("--prompt", default="ROMEO:\n")
    parser.add_argument("--tokens", type=int, default=400, help="characters to sample")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1337)
    add_result_options(parser, required=True)
    args = parser.parse_args(argv)
    out = check_result_file(parser, args)
    torch.manual_seed(args.seed)
    model, tokenizer, _ = load_run(args.run, "model", task="lm")
    model.eval()
    nano, info = load_nanogpt(args.nanogpt_ckpt)
    whole = resolve_tinyshakespeare(download=False).read_text(encoding="utf-8")
    chars = sorted(set(whole))  # nanoGPT's prepare.py: its vocabulary is the text's characters, sorted
    if nano.config.vocab_size != len(chars):
        sys.exit(f"nanoGPT's vocabulary has {nano.config.vocab_size} characters, the text {len(chars)}")
    qkv_chars = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    with torch.no_grad():
        samples = {
            "qkv": sample(model, {c: i for i, c in enumerate(qkv_chars)}, qkv_chars, args),
            "nanogpt": sample(nano, {c: i for i, c in enumerate(chars)}, chars, args),
        }
    settings = {k: getattr(args, k) for k in ("prompt", "tokens", "temperature", "top_k", "seed")}
    report = {
        "what": "samples of a qkv run and a nanoGPT checkpoint, the same settings, both through CausalLM.generate",
        "run": str(args.run),
        "nanogpt_checkpoint": str(args.nanogpt_ckpt),
        "nanogpt_iter": info.get("iter_num"),
        "settings": settings,
        "samples": samples,
    }
    write_result(out, report, argv)
    for name, text in samples.items():
        print(f"--- {name}\n{text}\n")


if __name__ == "__main__":
    main()
