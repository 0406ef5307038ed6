"""Train En->De (or any pair) on Multi30k from scratch for a fixed wall time and score it.

Writes a JSON with wall time, tokens/s, the validation BLEU-versus-minutes curve, and sacreBLEU +
chrF on val and test 2016 with beam 5 (and greedy), using the averaged last checkpoints.

    python benchmarks/train_multi30k.py --minutes 60 --src en --tgt de \
        --run-dir runs/multi30k-en-de --out benchmarks/results/multi30k_en_de.json

Other processes sharing the CPU depress the figures; the JSON records the load average.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from qkv import checkpoint as ckpt
from qkv.data import Tokenizer, load_multi30k, resolve_multi30k
from qkv.evaluation import score_translations, translate_texts
from qkv.models import Transformer, TransformerConfig
from qkv.training import TrainConfig, Trainer, plot_metrics

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "multi30k"))
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--minutes", type=float, default=60.0, help="training wall time (validation included)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=6000)
    p.add_argument("--warmup", type=int, default=800)
    p.add_argument("--lr-factor", type=float, default=1.0)
    p.add_argument("--eval-every-minutes", type=float, default=6.0)
    p.add_argument("--checkpoint-every-minutes", type=float, default=3.0)
    p.add_argument("--average-last", type=int, default=5)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N training pairs (smoke tests)")
    p.add_argument("--eval-limit", type=int, default=0, help="score only the first N val/test pairs (smoke tests)")
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pair = f"{args.src}_{args.tgt}"
    run_dir = Path(args.run_dir or REPO / "runs" / f"bench-multi30k-{pair}")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"multi30k_{pair}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    folder = resolve_multi30k(args.data)
    train = load_multi30k(folder, "train", args.src, args.tgt)
    val = load_multi30k(folder, "val", args.src, args.tgt)
    test = load_multi30k(folder, "test", args.src, args.tgt)
    if args.train_limit:
        train.src, train.tgt = train.src[: args.train_limit], train.tgt[: args.train_limit]
    if args.eval_limit:
        for split in (val, test):
            split.src, split.tgt = split.src[: args.eval_limit], split.tgt[: args.eval_limit]
    tokenizer = Tokenizer.train(train.src + train.tgt, vocab_size=args.vocab)
    prep_seconds = time.perf_counter() - t0
    model_config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, d_model=args.d_model,
        num_heads=args.heads, num_encoder_layers=args.layers, num_decoder_layers=args.layers, d_ff=args.d_ff,
        dropout=args.dropout, max_len=512, share_embeddings=True, tie_output=True, pad_id=tokenizer.pad_id,
    )
    train_config = TrainConfig(
        max_tokens=args.max_tokens, warmup_steps=args.warmup, lr_factor=args.lr_factor, bf16=not args.no_bf16,
        max_minutes=args.minutes, eval_every_minutes=args.eval_every_minutes, eval_sentences=300,
        checkpoint_every_minutes=args.checkpoint_every_minutes, average_last=args.average_last,
        progress=sys.stderr.isatty(), log_every_steps=10,
    )
    model = Transformer(model_config)
    config = {"model": asdict(model_config), "train": asdict(train_config),
              "data": {"source": "multi30k", "src_lang": args.src, "tgt_lang": args.tgt}}
    ckpt.create_run(run_dir, config, tokenizer, overwrite=True)
    trainer = Trainer(model, tokenizer, train, val, train_config, run_dir)
    train_start = time.perf_counter()
    state = trainer.train()
    train_wall = time.perf_counter() - train_start
    trainer.finish()
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png")

    results: dict = {}
    for weights in ("model", "last"):
        m, tok, _ = ckpt.load_run(run_dir, weights)
        entry = {}
        for name, split in (("val", val), ("test_2016", test)):
            for beam in ((args.beam, 1) if weights == "model" else (args.beam,)):
                start = time.perf_counter()
                hyps = translate_texts(m, tok, split.src, beam_size=beam, bf16=not args.no_bf16)
                scores = score_translations(hyps, split.tgt)
                scores["decode_seconds"] = round(time.perf_counter() - start, 1)
                entry[f"{name}_beam{beam}"] = scores
                logging.info("%s %s beam %d: BLEU %.2f chrF %.2f", weights, name, beam, scores["bleu"], scores["chrf"])
                if weights == "model" and beam == args.beam:
                    (run_dir / f"{name}.hyp.{args.tgt}").write_text("\n".join(hyps) + "\n", encoding="utf-8")
        results["averaged" if weights == "model" else "last"] = entry

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [{"minutes": r["minutes"], "step": r["step"], "val_bleu_greedy_300": r["val_bleu_greedy"],
              "val_loss": r["val_loss"]} for r in records if r["event"] == "valid"]
    report = {
        "task": f"Multi30k {args.src}->{args.tgt}",
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "train_wall_seconds": round(train_wall, 1),
        "train_minutes_budget": args.minutes,
        "prep_seconds": round(prep_seconds, 1),
        "steps": state.step,
        "epochs": round(state.epoch + state.batch_in_epoch / max(1, len(trainer._batches(state.epoch))), 2),
        "target_tokens": state.tokens,
        "target_tokens_per_s": round(state.tokens / max(state.seconds, 1e-9), 1),
        "bleu_vs_minutes": curve,
        "scores": results,
        "model": asdict(model_config),
        "train": asdict(train_config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                    "python": platform.python_version(), "loadavg_end": os.getloadavg()},
        "run_dir": str(run_dir),
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)
    print(json.dumps({k: report[k] for k in ("train_wall_seconds", "steps", "target_tokens_per_s")}, indent=None))
    print(json.dumps({k: {s: v["bleu"] for s, v in e.items()} for k, e in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
