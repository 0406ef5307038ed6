"""bfloat16 autocast (or torch.compile) against plain float32 on the same short Multi30k run:
speed and test BLEU.

Trains the Multi30k model (d_model 256, 4 heads, 3+3 layers, d_ff 1024, joint BPE 8k) twice from
the same initial weights, on the same batches in the same order, for the same number of optimizer
steps: once in float32, once under bfloat16 autocast (``--compare bf16``), with the loss call
compiled by ``torch.compile`` (``--compare compile``) or again in float32 with other dropout masks
(``--compare seed``: how much BLEU moves between two equally good runs at this length). Then
decodes test 2016 greedily, each model in the precision it was trained in (and the bf16-trained
model in float32 too), and scores it with sacreBLEU. The runs go one after the other, so their
tokens/s are not interleaved: the interleaved step speed-up is the ``precision`` suite's
(``python benchmarks/precision.py``).
Compiled code draws other dropout masks than eager code, so its BLEU change includes that noise;
``--compare seed`` measures it.

    python benchmarks/studies/precision_bleu.py --steps 200 --out benchmarks/results/performance/precision_bleu.json
    python benchmarks/studies/precision_bleu.py --compare compile --out benchmarks/results/performance/compile_bleu.json
    python benchmarks/studies/precision_bleu.py --compare seed --out benchmarks/results/performance/seed_bleu.json
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data import Tokenizer, load_multi30k, resolve_multi30k
from qkv.decoding.translate import translate_texts
from qkv.metrics.scores import score_translations
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runs import folder as ckpt
from qkv.runtime.precision import slow_bf16_reason
from qkv.training import TrainConfig, Trainer, TranslationTask

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache)")
    p.add_argument(
        "--compare",
        choices=("bf16", "compile", "seed"),
        default="bf16",
        help="what the second run changes against the float32 eager one",
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of each run")
    p.add_argument("--max-tokens", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lr-factor", type=float, default=0.35, help="peak lr = factor * 256^-0.5 * warmup^-0.5")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--test-limit", type=int, default=0, help="score only the first N test pairs (smoke runs)")
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N training pairs (smoke runs)")
    p.add_argument("--run-dir", default=str(REPO / "runs" / "precision-bleu"))
    add_result_options(p, REPO / "benchmarks" / "results" / "performance" / "precision_bleu.json")
    p.add_argument("--force", action="store_true", help="run even where bf16 is emulated (very slow)")
    args = p.parse_args()
    check_result_file(p, args)  # before any work
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    slow = slow_bf16_reason("cpu") if args.compare == "bf16" else None
    if slow and not args.force:
        print(
            f"precision_bleu: not run: {slow}; the bf16 run would take tens of times the fp32 one "
            "(--force runs it anyway)",
            file=sys.stderr,
        )
        return 2

    folder = resolve_multi30k(args.data, download=False)
    train = load_multi30k(folder, "train", "en", "de")
    test = load_multi30k(folder, "test", "en", "de")
    if args.train_limit:
        train.src, train.tgt = train.src[: args.train_limit], train.tgt[: args.train_limit]
    if args.test_limit:
        test.src, test.tgt = test.src[: args.test_limit], test.tgt[: args.test_limit]
    tokenizer = Tokenizer.train(train.src + train.tgt, vocab_size=8000)
    model_config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        d_model=256,
        num_heads=4,
        num_encoder_layers=3,
        num_decoder_layers=3,
        d_ff=1024,
        dropout=0.1,
        max_len=512,
        share_embeddings=True,
        tie_output=True,
        pad_id=tokenizer.pad_id,
    )
    torch.manual_seed(0)
    initial = Transformer(model_config).state_dict()
    runs = {}
    other = args.compare
    for name in ("fp32", other):
        bf16 = name == "bf16"
        train_config = TrainConfig(
            max_tokens=args.max_tokens,
            warmup_steps=args.warmup,
            lr_factor=args.lr_factor,
            bf16=bf16,
            compile=name == "compile",
            max_steps=args.steps,
            average_last=1,
            progress=False,
            log_every_steps=20,
            seed=0,
        )
        run_dir = Path(args.run_dir) / name
        ckpt.create_run(
            run_dir,
            {
                "model": asdict(model_config),
                "train": asdict(train_config),
                "data": {"source": "multi30k", "src_lang": "en", "tgt_lang": "de"},
            },
            tokenizer,
            overwrite=True,
        )
        model = Transformer(model_config)
        model.load_state_dict(copy.deepcopy(initial))
        torch.manual_seed(2 if name == "seed" else 1)  # dropout masks' seed: the same except for "seed"
        task = TranslationTask(tokenizer, train, None, max_len=model_config.max_len, pad_id=model_config.pad_id)
        trainer = Trainer(model, task, train_config, run_dir)
        start = time.perf_counter()
        state = trainer.train()
        seconds = time.perf_counter() - start
        entry = {
            "steps": state.step,
            "train_seconds": round(seconds, 1),
            "target_tokens": state.tokens,
            "tokens_per_s": round(state.tokens / seconds, 1),
        }
        decodings = [(name, bf16)] + ([("bf16_model_fp32_decoding", False)] if bf16 else [])
        for label, decode_bf16 in decodings:
            start = time.perf_counter()
            hyps = translate_texts(model, tokenizer, test.src, beam_size=1, bf16=decode_bf16)
            scores = score_translations(hyps, test.tgt)
            entry[f"test_bleu_{'bf16' if decode_bf16 else 'fp32'}_decoding"] = scores["bleu"]
            entry[f"test_chrf_{'bf16' if decode_bf16 else 'fp32'}_decoding"] = scores["chrf"]
            entry["bleu_signature"] = scores["bleu_signature"]
            logging.info(
                "%s (%s): test BLEU %.2f, chrF %.2f, %.0f s to decode",
                name,
                label,
                scores["bleu"],
                scores["chrf"],
                time.perf_counter() - start,
            )
        runs[name] = entry
        model.train()
    fp32_bleu = runs["fp32"]["test_bleu_fp32_decoding"]
    other_decoding = "bf16" if other == "bf16" else "fp32"  # each model decodes as it was trained
    report = {
        "suite": "precision_bleu",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "environment": environment(),
        "model": asdict(model_config),
        "train": {
            "steps": args.steps,
            "max_tokens": args.max_tokens,
            "warmup": args.warmup,
            "lr_factor": args.lr_factor,
            "train_pairs": len(train.src),
            "test_pairs": len(test.src),
            "decoding": "greedy",
        },
        "runs": runs,
        "compare": other,
        f"bleu_change_{other}_minus_fp32": round(runs[other][f"test_bleu_{other_decoding}_decoding"] - fp32_bleu, 2),
        f"sequential_speedup_{other}": round(runs[other]["tokens_per_s"] / runs["fp32"]["tokens_per_s"], 3),
    }
    if other == "bf16":
        report["bleu_change_bf16_model_fp32_decoding"] = round(runs["bf16"]["test_bleu_fp32_decoding"] - fp32_bleu, 2)
    write_result(args.out, report)
    print({k: v for k, v in report.items() if k.startswith(("bleu_change", "sequential_speedup"))})
    print({name: {k: v for k, v in r.items() if k != "bleu_signature"} for name, r in runs.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
