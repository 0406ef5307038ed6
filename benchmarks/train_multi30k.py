"""Train En->De (or any pair) on Multi30k from scratch for a fixed wall time and score it.

Writes a JSON with wall time, tokens/s, the validation BLEU-versus-minutes curve, and sacreBLEU +
chrF on val and test 2016 with beam 5 (and greedy) for the averaged last checkpoints, plus test 2016
with beam 5 for the last weights alone (what averaging adds). The later test sets (test 2017 Flickr
and MSCOCO, test 2018 Flickr) are scored too when the data folder or qkv's cache holds them (``qkv
evaluate RUN --split test_2017_flickr`` fetches one); they are named under ``test_sets_not_found``
otherwise. Every score also carries BLEU in the
papers' form (``bleu_papers_form``: lowercased, Moses-normalised and tokenized, as Multi30k papers
report it) and, for a German target, ``bleu_compound_split`` (qkv.metrics.bleu_forms), each labelled.

    python benchmarks/train_multi30k.py --minutes 60 --src en --tgt de \\
        --run-dir runs/multi30k-en-de --out runs/multi30k-en-de.json

Defaults are the library's Multi30k recipe (qkv.runs.recipes.RECIPES["multi30k"]): d_model 256, 4 heads,
3+3 layers, d_ff 1024, joint byte-level BPE 8k with shared embeddings, label smoothing 0.1, bf16
autocast where the hardware runs it fast, GELU, dropout 0.1, ~2k padded tokens a batch, warmup 800 x
factor 0.7 (--recipe multi30k-bf16, for where bf16 is fast and the hour holds ~3.5x the steps: ReLU, dropout 0.2, factor 0.5), the
rate brought to zero over the budget's last 30%, checkpoints every 3 minutes with the last 2 averaged.
Every option below overrides one field of it. An existing --out is kept unless --overwrite is given.
Other processes sharing the CPU depress the figures; the JSON records the load average. Smoke test:

    python benchmarks/train_multi30k.py --minutes 1 --train-limit 3000 --eval-limit 40 --run-dir /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options
from qkv.bench.timing import environment
from qkv.cli.train import (
    Terminated,
    add_model_arguments,
    add_train_arguments,
    model_options_from,
    sigterm_saves_first,
    train_options_from,
)
from qkv.data.parallel import MULTI30K_LATER_TESTS, load_multi30k, resolve_multi30k
from qkv.data.sources import load_split
from qkv.data.spec import DataSpec
from qkv.decoding.translate import translate_texts
from qkv.metrics.scores import score_translations
from qkv.runs import folder as ckpt
from qkv.runs.recipes import decode_settings
from qkv.runs.translation import resume_run, run_training, start_run
from qkv.runtime.device import pick_device
from qkv.runtime.fileio import check_output_file, write_text
from qkv.runtime.heap import limit_memory_growth

REPO = Path(__file__).resolve().parent.parent


def parse_options(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict, dict]:
    """The command line, and the model and training fields it sets over the recipe's."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache, as qkv train finds it)"
    )
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument(
        "--both-directions",
        action="store_true",
        help="train on the pairs and the same pairs reversed (qkv train --both-directions)",
    )
    p.add_argument("--threads", type=int, default=2)
    # the model and training options are qkv train's own (declared once, in qkv.cli.train), defaulting
    # to the recipe's values; --layers is this script's shorthand for as many encoder as decoder layers
    model = p.add_argument_group("model (default: the recipe's, qkv.runs.recipes)")
    add_model_arguments(model, translation_only=True)
    model.add_argument("--layers", dest="both_layers", type=int, help="encoder and decoder layers each")
    add_train_arguments(p.add_argument_group("training (default: the recipe's; see qkv train --help)"))
    p.set_defaults(max_minutes=60.0, seed=0, eval_sentences=300, log_every_steps=10)
    p.add_argument(
        "--recipe",
        default="multi30k",
        help="the recipe to start from (default multi30k; the runs on fast-bf16 Xeons before qkv 1.0 were multi30k-bf16)",
    )
    p.add_argument("--beam", type=int, default=None, help="beam size (default: the recipe's, qkv.runs.recipes)")
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N training pairs (smoke tests)")
    p.add_argument("--eval-limit", type=int, default=0, help="score only the first N val/test pairs (smoke tests)")
    p.add_argument("--run-dir", default=None)
    add_result_options(
        p, what="the result JSON (default runs/multi30k_<src>_<tgt>.json, beside the default run folder)"
    )
    p.add_argument("--note", default=None, help="a remark stored in the JSON (e.g. what else ran)")
    p.add_argument(
        "--score-only",
        action="store_true",
        help="score the finished run in --run-dir again and write the JSON, without training",
    )
    args = p.parse_args(argv)
    model_options = model_options_from(args, is_lm=False)
    if args.both_layers is not None:  # --encoder-layers / --decoder-layers, when given too, win
        model_options = {
            "num_encoder_layers": args.both_layers,
            "num_decoder_layers": args.both_layers,
            **model_options,
        }
    # --no-bf16 gives float32 even where bf16 is fast; otherwise the recipe's bf16 where it is fast
    train_options = {**train_options_from(args), "progress": sys.stderr.isatty()}
    return args, model_options, train_options


def main() -> int:
    args, model_options, train_options = parse_options()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    pair = f"{args.src}_{args.tgt}"
    run_dir = Path(args.run_dir or REPO / "runs" / f"bench-multi30k-{pair}")
    out = Path(args.out or REPO / "runs" / f"multi30k_{pair}.json")  # beside the run, not over a committed result
    try:
        check_output_file(out, "--out", overwrite=args.overwrite)  # before the hour, not after it
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    device = str(pick_device())  # CUDA where there is one, else the CPU
    try:  # --data, $QKV_DATA/multi30k or the cache; none: start_run looks again after checking every option
        folder = str(resolve_multi30k(args.data, download=False).resolve())  # (and downloads, as qkv train does)
    except FileNotFoundError:
        folder = args.data
    data = DataSpec(
        source="multi30k", folder=folder, src_lang=args.src, tgt_lang=args.tgt, both_directions=args.both_directions
    )

    limit_memory_growth()  # as the CLI does, before the first oneDNN primitive (the bf16 probe is one)
    t0 = time.perf_counter()
    try:  # an option out of range, missing data, a --run-dir that is not a run folder: one line, nothing written
        if args.score_only:  # the run folder of a finished run: score it again (decoding is deterministic)
            trainer = resume_run(run_dir, device=device)
        else:
            trainer = start_run(
                run_dir,
                data=data,
                model_options=model_options,
                train_options=train_options,
                vocab_size=args.vocab_size,
                overwrite=True,
                device=device,
                recipe=args.recipe,
            )
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.score_only:
        prep_seconds, train_wall = None, trainer.state.seconds
    else:
        task = trainer.task
        if args.train_limit:  # smoke tests: fewer pairs (the tokenizer was learned on all of them)
            task.keep_first(args.train_limit)
        if args.eval_limit and task.valid is not None:
            limit = args.eval_limit
            task.valid.src, task.valid.tgt = task.valid.src[:limit], task.valid.tgt[:limit]
        prep_seconds = time.perf_counter() - t0
        train_start = time.perf_counter()
        try:
            with sigterm_saves_first():  # SIGTERM, like Ctrl-C, saves the last whole step before the end
                run_training(trainer)
        except KeyboardInterrupt as err:
            print(
                f"stopped: checkpoint saved at step {trainer.state.step}; continue with qkv train --run-dir "
                f"{run_dir} --resume (the run keeps its budget), then score it with this script's "
                f"--score-only --run-dir {run_dir}",
                file=sys.stderr,
            )
            return 128 + signal.SIGTERM if isinstance(err, Terminated) else 130
        train_wall = time.perf_counter() - train_start
    state = trainer.state

    splits, later_missing = evaluation_splits(data)
    results: dict = {}
    bf16 = trainer.config.bf16
    decode = decode_settings(ckpt.read_run_config(run_dir), beam_size=args.beam)  # the recipe's, as qkv evaluate
    for weights in ("model", "last"):
        model, tokenizer, _ = ckpt.load_run(run_dir, weights)
        model.to(device)
        if weights == "model":
            results["averaged"] = score_splits(
                model,
                tokenizer,
                splits,
                beams=(decode["beam_size"], 1),
                alpha=decode["alpha"],
                bf16=bf16,
                tgt=args.tgt,
                limit=args.eval_limit,
                label=weights,
                hyp_dir=run_dir,
            )
        else:  # the last weights alone are scored on test only: what averaging adds
            results["last"] = score_splits(
                model,
                tokenizer,
                {"test_2016": splits["test_2016"]},
                beams=(decode["beam_size"],),
                alpha=decode["alpha"],
                bf16=bf16,
                tgt=args.tgt,
                limit=args.eval_limit,
                label=weights,
            )

    metrics = run_dir / "metrics.jsonl"  # absent when a short run logged and validated nothing
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    curve = [
        {
            "minutes": r["minutes"],
            "step": r["step"],
            "val_bleu_greedy_300": r["val_bleu_greedy"],
            "val_loss": r["val_loss"],
        }
        for r in records
        if r["event"] == "valid"
    ]
    config = ckpt.read_run_config(run_dir)
    report = {
        "task": f"Multi30k {args.src}->{args.tgt}",
        "command": " ".join(["python"] + sys.argv),
        "train_wall_seconds": round(train_wall, 1),
        "train_minutes_budget": args.max_minutes,
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
        "machine": {**environment(), "threads": args.threads, "device": device, "loadavg_end": os.getloadavg()},
        "note": args.note,
        "run_dir": str(run_dir),
    }
    write_result(out, report)
    print(json.dumps({k: report[k] for k in ("train_wall_seconds", "steps", "target_tokens_per_s")}))
    print(
        json.dumps(
            {k: {s: [v["bleu"], v["bleu_papers_form"]["bleu"]] for s, v in e.items()} for k, e in results.items()}
        )
    )  # sacreBLEU, papers' form
    return 0


def evaluation_splits(data: DataSpec) -> tuple[dict, list[str]]:
    """Validation, test 2016 and the later test sets the folder or the cache holds (those score the
    finished model only: nothing is chosen on them), and the names of the later ones missing."""
    splits = {"val": load_split(data, "val"), "test_2016": load_split(data, "test")}
    missing = []
    for stem in MULTI30K_LATER_TESTS:
        try:
            folder = resolve_multi30k(data.folder, download=False)  # None: qkv's lookup
            splits[stem] = load_multi30k(folder, stem, data.src_lang, data.tgt_lang)
        except FileNotFoundError:
            missing.append(stem)
    if missing:
        logging.info("not scored (not in %s nor the cache): %s", data.folder, ", ".join(missing))
    return splits, missing


def score_splits(
    model,
    tokenizer,
    splits: dict,
    *,
    beams: tuple[int, ...],
    alpha: float,
    bf16: bool,
    tgt: str,
    limit: int = 0,
    label: str = "",
    hyp_dir: Path | None = None,
) -> dict:
    """sacreBLEU, chrF and the papers' BLEU forms of ``model`` on every split with every beam size:
    ``{"<split>_beam<k>": scores}``. With ``hyp_dir``, the first beam's translations are written
    there as ``<split>.hyp.<tgt>``."""
    entry = {}
    for name, split in splits.items():
        src, refs = split.src, split.tgt
        if limit:
            src, refs = src[:limit], refs[:limit]
        for beam in beams:
            start = time.perf_counter()
            hyps = translate_texts(model, tokenizer, src, beam_size=beam, alpha=alpha, bf16=bf16)
            scores = score_translations(hyps, refs, target_lang=tgt)  # + the papers' BLEU forms
            scores["decode_seconds"] = round(time.perf_counter() - start, 1)
            entry[f"{name}_beam{beam}"] = scores
            logging.info(
                "%s %s beam %d: BLEU %.2f chrF %.2f, papers' form BLEU %.2f",
                label,
                name,
                beam,
                scores["bleu"],
                scores["chrf"],
                scores["bleu_papers_form"]["bleu"],
            )
            if hyp_dir is not None and beam == beams[0]:
                write_text(hyp_dir / f"{name}.hyp.{tgt}", "".join(h + "\n" for h in hyps))
    return entry


if __name__ == "__main__":
    sys.exit(main())
