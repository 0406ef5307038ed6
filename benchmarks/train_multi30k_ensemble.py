"""Train several Multi30k models side by side in one wall-clock budget and score them as an ensemble.

Each member is ``benchmarks/train_multi30k.py`` in its own process with its own seed and an equal
share of the CPU threads (2 cores, 2 members: one thread each), all starting together and stopping
at the same deadline, so the ensemble costs the same hour as one model. On 2 cores two one-thread
processes do more work together than one two-thread process (the small matrices of a d 256 model
do not split well over threads). When they are done, the members decode together
(:class:`qkv.decoding.ensemble.Ensemble`, their next-token probabilities averaged) with the recipe's beam 5 and
length penalty 0.6, or with the length penalty that scores best on the validation set among
``--alphas`` (never chosen on a test set); then every test set is scored once with it. Each
member's own scores are in its JSON (and summarised in this one).

    python benchmarks/train_multi30k_ensemble.py --members 2 --minutes 60 --src en --tgt de \\
        --run-dir runs/multi30k-en-de-ensemble --out benchmarks/results/multi30k/ensembles/multi30k_en_de_ensemble.json

Options this script does not know (``--minutes``, ``--dropout``, any model or training option) go
to every member's train_multi30k.py. Smoke test:

    python benchmarks/train_multi30k_ensemble.py --minutes 1 --train-limit 3000 --eval-limit 40 \\
        --run-dir /tmp/smoke-ensemble --out /tmp/smoke-ensemble.json

Then ``qkv evaluate RUN/member0 --ensemble RUN/member1 --alpha A --bf16`` scores the same ensemble
again (``--bf16`` where the members trained in bf16: this script decodes as they trained; float32
decoding, ``qkv evaluate``'s default, can differ by a tenth of a BLEU point).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.runs.folder import load_translator
from qkv.runs.recipes import decode_settings

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_multi30k import evaluation_splits, score_splits  # noqa: E402  (a sibling script)


def parse_options(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=2, help="models trained side by side (default 2)")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="CPU threads shared out among the members (default: all cores)",
    )
    p.add_argument("--seed", type=int, default=0, help="member i trains with seed + i")
    p.add_argument(
        "--alphas",
        default="",
        help="length penalties to try on the validation set, e.g. 0.6,1.0,1.4; the best one scores the "
        "test sets (default: the recipe's, 0.6, untried)",
    )
    p.add_argument(
        "--beam", type=int, default=None, help="beam size, the ensemble's and each member's (default: the recipe's)"
    )
    p.add_argument(
        "--data", default=None, help="Multi30k folder (default: $QKV_DATA/multi30k or the cache, as qkv train finds it)"
    )
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--eval-limit", type=int, default=0, help="score only the first N val/test pairs (smoke tests)")
    p.add_argument("--run-dir", required=True, help="folder of the members' run folders (member0, member1, ...)")
    add_result_options(p, required=True)
    p.add_argument("--note", default=None, help="a remark stored in the JSON (e.g. what else ran)")
    p.add_argument("--score-only", action="store_true", help="score the finished members again, without training")
    args, member_options = p.parse_known_args(argv)
    if args.members < 2:
        p.error("--members must be at least 2 (one model: benchmarks/train_multi30k.py)")
    if args.threads < args.members:
        p.error(f"--threads {args.threads} cannot give each of {args.members} members a thread")
    try:
        args.alpha_list = [float(a) for a in args.alphas.split(",") if a.strip()]
    except ValueError:
        p.error(f"--alphas takes numbers separated by commas, e.g. 0.6,1.0,1.4; got {args.alphas!r}")
    if not all(0 <= a <= 10 for a in args.alpha_list):
        p.error(f"--alphas: each length penalty must be from 0 to 10, got {args.alphas!r}")
    if not args.score_only:  # an hour of training per member must not be replaced by a rerun
        done = [
            str(Path(args.run_dir) / f"member{i}")
            for i in range(args.members)
            if (Path(args.run_dir) / f"member{i}").exists()
        ]
        if done:
            p.error(f"{', '.join(done)} exist: score them with --score-only, or choose another --run-dir")
    check_result_file(p, args)  # before an hour of training, not after
    if not args.score_only:
        from qkv.data import resolve_multi30k

        try:  # the members get the folder found: --data, $QKV_DATA/multi30k or the cache (as qkv train)
            args.data = str(resolve_multi30k(args.data).resolve())
        except FileNotFoundError as err:
            p.error(str(err))
    return args, member_options


def train_members(args: argparse.Namespace, member_options: list[str], run_dir: Path) -> None:
    """Start every member at once and wait for all; Ctrl-C or SIGTERM is passed on to each (each
    saves its last whole step, as train_multi30k.py does)."""
    threads = args.threads // args.members
    procs = []
    for i in range(args.members):
        command = [
            sys.executable,
            str(HERE / "train_multi30k.py"),
            "--src",
            args.src,
            "--tgt",
            args.tgt,
            "--data",
            args.data,
            "--threads",
            str(threads),
            "--seed",
            str(args.seed + i),
            "--run-dir",
            str(run_dir / f"member{i}"),
            "--out",
            str(run_dir / f"member{i}.json"),
            "--eval-limit",
            str(args.eval_limit),
            *(["--beam", str(args.beam)] if args.beam else []),
            "--note",
            f"member {i} of {args.members} trained side by side",
            *member_options,
        ]
        log = open(run_dir / f"member{i}.log", "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log))
        logging.info("member %d: %s (log %s)", i, " ".join(command[1:]), log.name)

    def stop(signum, frame):
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        codes = [proc.wait() for proc, _ in procs]
    except KeyboardInterrupt:
        stop(None, None)
        codes = [proc.wait() for proc, _ in procs]
    finally:
        signal.signal(signal.SIGTERM, previous)
        for _, log in procs:
            log.close()
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed:
        raise SystemExit(
            f"member(s) {failed} stopped with exit codes {[codes[i] for i in failed]}; see "
            f"{run_dir}/member<i>.log. A stopped member resumes with qkv train --run-dir "
            f"{run_dir}/member<i> --resume; then rerun this script with --score-only"
        )


def main() -> int:
    args, member_options = parse_options()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run_dir, out = Path(args.run_dir), Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not args.score_only:
        train_members(args, member_options, run_dir)
    wall = time.perf_counter() - start

    torch.set_num_threads(args.threads)
    members = [run_dir / f"member{i}" for i in range(args.members)]
    model, tokenizer, config = load_translator(members, "model")
    data = config["data"]
    splits, later_missing = evaluation_splits(data)
    decode = decode_settings(config, beam_size=args.beam)
    bf16 = bool(config["train"].get("bf16"))
    common = dict(bf16=bf16, tgt=args.tgt, limit=args.eval_limit)
    search = {}
    for alpha in args.alpha_list:  # the length penalty, chosen on validation only
        scores = score_splits(
            model,
            tokenizer,
            {"val": splits["val"]},
            beams=(decode["beam_size"],),
            alpha=alpha,
            label=f"ensemble alpha {alpha}",
            **common,
        )
        search[str(alpha)] = scores[f"val_beam{decode['beam_size']}"]["bleu"]
    alpha = max(args.alpha_list, key=lambda a: search[str(a)]) if search else decode["alpha"]
    if search:
        logging.info("length penalty chosen on validation: %s (%s)", alpha, search)
    scores = score_splits(
        model,
        tokenizer,
        splits,
        beams=(decode["beam_size"], 1),
        alpha=alpha,
        label="ensemble",
        hyp_dir=run_dir,
        **common,
    )
    at_recipe_alpha = (
        score_splits(
            model,
            tokenizer,
            {"test_2016": splits["test_2016"]},
            beams=(decode["beam_size"],),
            alpha=decode["alpha"],
            label="ensemble, recipe alpha",
            **common,
        )
        if alpha != decode["alpha"]
        else None
    )

    summaries = []
    for i in range(args.members):
        path = run_dir / f"member{i}.json"
        report = json.loads(path.read_text()) if path.is_file() else {}
        averaged = report.get("scores", {}).get("averaged", {})
        summaries.append(
            {
                "run_dir": str(members[i]),
                "seed": args.seed + i,
                "steps": report.get("steps"),
                "epochs": report.get("epochs"),
                "target_tokens_per_s": report.get("target_tokens_per_s"),
                "threads": report.get("machine", {}).get("threads"),
                "scores": {
                    k: {"bleu": v["bleu"], "bleu_papers_form": v["bleu_papers_form"]["bleu"]}
                    for k, v in averaged.items()
                },
            }
        )
    report = {
        "task": f"Multi30k {args.src}->{args.tgt}, an ensemble of {args.members} models trained side by side",
        "command": " ".join(["python"] + sys.argv),
        "wall_seconds_training": None if args.score_only else round(wall, 1),
        "members": summaries,
        "decode": {
            "beam_size": decode["beam_size"],
            "alpha": alpha,
            "alpha_chosen_on": "val" if search else "the recipe",
            "val_bleu_by_alpha": search,
        },
        "scores": scores,
        "test_2016_at_the_recipe_alpha": at_recipe_alpha and {"alpha": decode["alpha"], **at_recipe_alpha},
        "test_sets_not_found": later_missing,
        "model": config["model"],
        "train": config["train"],
        "machine": {**environment(), "threads": args.threads, "loadavg_end": os.getloadavg()},
        "note": args.note,
        "run_dir": str(run_dir),
    }
    write_result(out, report)
    print(json.dumps({k: [v["bleu"], v["bleu_papers_form"]["bleu"]] for k, v in scores.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
