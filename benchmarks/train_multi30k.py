"""Train En->De (or any pair) on Multi30k from scratch for a fixed wall time and score it.

Writes a JSON with wall time, tokens/s, the validation BLEU-versus-minutes curve, and sacreBLEU +
chrF on val and test 2016 with beam 5 (and greedy) for the averaged last checkpoints, plus test 2016
with beam 5 for the last weights alone (what averaging adds). The later test sets (test 2017 Flickr
and MSCOCO, test 2018 Flickr) are scored too when the data folder or qkv's cache holds them (``qkv
evaluate RUN --split test_2017_flickr`` fetches one); they are named under ``test_sets_not_found``
otherwise. Every score also carries BLEU in the
papers' form (``bleu_papers_form``: lowercased, Moses-normalised and tokenized, as Multi30k papers
report it) and, for a German target, ``bleu_compound_split`` (qkv.bleu_forms), each labelled.

    python benchmarks/train_multi30k.py --minutes 60 --src en --tgt de \\
        --run-dir runs/multi30k-en-de --out benchmarks/results/multi30k_en_de.json

Defaults are the library's Multi30k recipe (qkv.recipes.RECIPES["multi30k"]): d_model 256, 4 heads,
3+3 layers, d_ff 1024, joint byte-level BPE 8k with shared embeddings, label smoothing 0.1, bf16
autocast where the hardware runs it fast, dropout 0.1 (0.2 in fast bf16: more epochs fit the hour),
~4k padded tokens a batch, warmup 400 x factor 0.7, the rate brought to zero over the budget's last
30%, checkpoints every 3 minutes with the last 2 averaged. Every option below overrides one field of it. Other processes sharing the CPU depress the
figures; the JSON records the load average. Smoke test:

    python benchmarks/train_multi30k.py --minutes 1 --train-limit 3000 --eval-limit 40 --run-dir /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

from qkv import checkpoint as ckpt
from qkv.bench.timing import environment
from qkv.data.parallel import MULTI30K_LATER_TESTS, load_multi30k
from qkv.data.sources import load_split
from qkv.evaluation import score_translations, translate_texts
from qkv.runs import resume_run, run_training, start_run
from qkv.memory import limit_memory_growth
from qkv.recipes import decode_settings

REPO = Path(__file__).resolve().parent.parent

# command-line option -> (TransformerConfig or TrainConfig field); None = the recipe's value
MODEL_OPTIONS = {"d_model": "d_model", "heads": "num_heads", "layers": None, "d_ff": "d_ff", "dropout": "dropout",
                 "attention_dropout": "attention_dropout"}
TRAIN_OPTIONS = {"max_tokens": "max_tokens", "warmup": "warmup_steps", "lr_factor": "lr_factor",
                 "eval_every_minutes": "eval_every_minutes", "checkpoint_every_minutes": "checkpoint_every_minutes",
                 "average_last": "average_last", "label_smoothing": "label_smoothing", "accum_steps": "accum_steps",
                 "schedule": "schedule", "decay_fraction": "decay_fraction", "max_steps": "max_steps",
                 "checkpoint_every_steps": "checkpoint_every_steps"}


def _cpu_flags() -> str:
    try:
        return " " + Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "multi30k"), help="Multi30k folder")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--minutes", type=float, default=60.0, help="training wall time (validation included)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=None, help="joint BPE vocabulary (recipe: 8000)")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--layers", type=int, default=None, help="encoder and decoder layers each")
    p.add_argument("--d-ff", type=int, default=None)
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--attention-dropout", type=float, default=None, help="dropout on the attention weights")
    p.add_argument("--max-tokens", type=int, default=None, help="padded tokens a batch")
    p.add_argument("--accum-steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--lr-factor", type=float, default=None)
    p.add_argument("--label-smoothing", type=float, default=None)
    p.add_argument("--eval-every-minutes", type=float, default=None)
    p.add_argument("--checkpoint-every-minutes", type=float, default=None)
    p.add_argument("--average-last", type=int, default=None)
    p.add_argument("--schedule", choices=["inverse_sqrt", "budget"], default=None, help="learning-rate schedule")
    p.add_argument("--decay-fraction", type=float, default=None, help="with --schedule budget (see qkv train --help)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps as well (a budget in steps is independent of the machine's load)")
    p.add_argument("--checkpoint-every-steps", type=int, default=None,
                   help="keep a checkpoint every N steps (use with --checkpoint-every-minutes 0)")
    p.add_argument("--beam", type=int, default=None, help="beam size (default: the recipe's, qkv.recipes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N training pairs (smoke tests)")
    p.add_argument("--eval-limit", type=int, default=0, help="score only the first N val/test pairs (smoke tests)")
    p.add_argument("--no-bf16", action="store_true", help="float32 even where bf16 is fast")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--note", default=None, help="a remark stored in the JSON (e.g. what else ran)")
    p.add_argument("--score-only", action="store_true",
                   help="score the finished run in --run-dir again and write the JSON, without training")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    pair = f"{args.src}_{args.tgt}"
    run_dir = Path(args.run_dir or REPO / "runs" / f"bench-multi30k-{pair}")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"multi30k_{pair}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model_options = {field: getattr(args, opt) for opt, field in MODEL_OPTIONS.items()
                     if field and getattr(args, opt) is not None}
    if args.layers is not None:
        model_options.update(num_encoder_layers=args.layers, num_decoder_layers=args.layers)
    train_options = {field: getattr(args, opt) for opt, field in TRAIN_OPTIONS.items()
                     if getattr(args, opt) is not None}
    train_options.update(max_minutes=args.minutes, seed=args.seed, eval_sentences=300,
                         progress=sys.stderr.isatty(), log_every_steps=10)
    if args.no_bf16:
        train_options["bf16"] = False  # else the recipe's: bf16 where this machine runs it fast
    data = {"source": "multi30k", "folder": str(Path(args.data).resolve()), "src_lang": args.src, "tgt_lang": args.tgt}

    limit_memory_growth()  # as the CLI does, before the first oneDNN primitive (the bf16 probe is one)
    t0 = time.perf_counter()
    if args.score_only:  # the run folder of a finished run: score it again (decoding is deterministic)
        trainer = resume_run(run_dir, device=device)
        prep_seconds, train_wall = None, trainer.state.seconds
    else:
        trainer = start_run(run_dir, data=data, model_options=model_options, train_options=train_options,
                            vocab_size=args.vocab, overwrite=True, device=device)
        task = trainer.task
        if args.train_limit:  # smoke tests: fewer pairs (the tokenizer was learned on all of them)
            task.src_ids, task.tgt_ids = task.src_ids[: args.train_limit], task.tgt_ids[: args.train_limit]
            task.src_lengths = task.src_lengths[: args.train_limit]
            task.tgt_lengths = task.tgt_lengths[: args.train_limit]
        if args.eval_limit and task.valid is not None:
            limit = args.eval_limit
            task.valid.src, task.valid.tgt = task.valid.src[:limit], task.valid.tgt[:limit]
        prep_seconds = time.perf_counter() - t0
        train_start = time.perf_counter()
        run_training(trainer)
        train_wall = time.perf_counter() - train_start
    state = trainer.state

    splits = {"val": load_split(data, "val"), "test_2016": load_split(data, "test")}
    later_missing = []  # the later test sets score the finished model only: nothing is chosen on them
    for stem in MULTI30K_LATER_TESTS:
        try:
            splits[stem] = load_multi30k(data["folder"], stem, args.src, args.tgt)  # the folder, else the cache
        except FileNotFoundError:
            later_missing.append(stem)
    if later_missing:
        logging.info("not scored (not in %s nor the cache): %s", data["folder"], ", ".join(later_missing))
    results: dict = {}
    bf16 = trainer.config.bf16
    decode = decode_settings(ckpt.read_run_config(run_dir), beam_size=args.beam)  # the recipe's, as qkv evaluate
    for weights in ("model", "last"):
        model, tokenizer, _ = ckpt.load_run(run_dir, weights)
        model.to(device)
        entry = {}
        for name, split in splits.items():
            if weights == "last" and name != "test_2016":
                continue  # the last weights alone are scored on test only: what averaging adds
            src, refs = split.src, split.tgt
            if args.eval_limit:
                src, refs = src[: args.eval_limit], refs[: args.eval_limit]
            for beam in ((decode["beam_size"], 1) if weights == "model" else (decode["beam_size"],)):
                start = time.perf_counter()
                hyps = translate_texts(model, tokenizer, src, beam_size=beam, alpha=decode["alpha"], bf16=bf16)
                scores = score_translations(hyps, refs, target_lang=args.tgt)  # + the papers' BLEU forms
                scores["decode_seconds"] = round(time.perf_counter() - start, 1)
                entry[f"{name}_beam{beam}"] = scores
                logging.info("%s %s beam %d: BLEU %.2f chrF %.2f, papers' form BLEU %.2f", weights, name, beam,
                             scores["bleu"], scores["chrf"], scores["bleu_papers_form"]["bleu"])
                if weights == "model" and beam == decode["beam_size"]:
                    with ckpt.atomic_path(run_dir / f"{name}.hyp.{args.tgt}") as tmp:
                        tmp.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        results["averaged" if weights == "model" else "last"] = entry

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [{"minutes": r["minutes"], "step": r["step"], "val_bleu_greedy_300": r["val_bleu_greedy"],
              "val_loss": r["val_loss"]} for r in records if r["event"] == "valid"]
    config = ckpt.read_run_config(run_dir)
    report = {
        "task": f"Multi30k {args.src}->{args.tgt}",
        "command": " ".join(["python"] + sys.argv),
        "train_wall_seconds": round(train_wall, 1),
        "train_minutes_budget": args.minutes,
        "prep_seconds": None if prep_seconds is None else round(prep_seconds, 1),
        "steps": state.step,
        "epochs": round(state.epoch + state.batch_in_epoch / max(1, len(trainer._epoch_batches(state.epoch))), 2),
        "target_tokens": state.tokens,
        "target_tokens_per_s": round(state.tokens / max(state.seconds, 1e-9), 1),
        "bleu_vs_minutes": curve,
        "decode": decode,
        "scores": results,
        "test_sets_not_found": later_missing,
        "model": config["model"],
        "train": config["train"],
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "machine": {**environment(), "threads": args.threads, "device": device,
                    "avx512_bf16": " avx512_bf16" in _cpu_flags(), "amx": " amx_tile" in _cpu_flags(),
                    "loadavg_end": os.getloadavg()},
        "note": args.note,
        "run_dir": str(run_dir),
    }
    ckpt.write_json(out, report)
    print(json.dumps({k: report[k] for k in ("train_wall_seconds", "steps", "target_tokens_per_s")}))
    print(json.dumps({k: {s: [v["bleu"], v["bleu_papers_form"]["bleu"]] for s, v in e.items()}
                      for k, e in results.items()}))  # sacreBLEU, papers' form
    return 0


if __name__ == "__main__":
    sys.exit(main())
