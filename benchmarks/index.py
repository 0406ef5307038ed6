"""Write benchmarks/results/INDEX.md from the result JSONs: for each file, what it measures, its
headline figure (values read from the file), the machine, date and commit it records; grouped by
folder. Never edit INDEX.md by hand: tests/test_benchmark_results.py fails when it differs from what
this script writes.

    python benchmarks/index.py            # rewrite benchmarks/results/INDEX.md
    python benchmarks/index.py --check    # exit 1 if INDEX.md is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
INDEX = RESULTS / "INDEX.md"

# folder -> what its results are; the order the index lists them in (others follow, by name)
FOLDERS = {
    "demo": "`qkv demo` end to end: the set-up command a new user runs first.",
    "multi30k": "Multi30k translation: hour-long (and shorter) training runs of benchmarks/train_multi30k.py, "
    "each beside its decoding study (`*_decoding.json`).",
    "multi30k/ensembles": "Multi30k ensembles trained side by side in one budget "
    "(benchmarks/train_multi30k_ensemble.py), their members, reranking and decoding probes.",
    "multi30k/significance": "Paired bootstrap and approximate randomization between finished Multi30k runs "
    "(benchmarks/significance.py).",
    "multi30k/sweeps": "Recipe candidates compared: hour runs collected into one validation table "
    "(benchmarks/recipe_sweep.py) and step-matched sweeps on a GPU "
    "(benchmarks/step_matched_sweep.py).",
    "multi30k/other-directions": "Multi30k De->En and En->Fr runs.",
    "language-model": "The character-level language model on tiny Shakespeare (benchmarks/train_lm.py).",
    "explorer": "The attention explorer: a comparison of two sentences and the browser's drawing time.",
    "experiments": "`qkv experiment` runs: why attention works (long range, permutation, scaling, softmax scaling, "
    "ViT on digits).",
    "distributed": "Several processes: tokens/s of 1 or 2 processes and threads, and a DDP run of the date task.",
    "paper-scale": "Paper-scale data: `qkv prepare` and 2-process training on generated WMT-sized corpora, "
    "and verifying a prepared folder.",
    "gpu": "Runs on lent GPUs: the CUDA checks (benchmarks/cuda_checks.sh), attention, a short Multi30k run.",
    "performance": "Speed and memory on CPUs: qkv bench suites, the training step's fast paths, the fused loss, "
    "memory over long runs, tokenization.",
    "reliability": "Crash consistency under SIGKILL and `qkv serve` under load.",
    "attention": "The attention of today's models: mask functions as boolean masks against FlexAttention "
    "(benchmarks/mask_functions.py), and what each part costs in time and memory "
    "(benchmarks/modern_attention_cost.py).",
}


# ----------------------------------------------------------------------------- reading values
def get(data, path: str, default=None):
    """``data``'s value at the dotted ``path`` (list indices as numbers), or ``default``."""
    value = data
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            return default
    return value


def fmt(value) -> str:
    """A value as the index shows it: numbers to 4 significant digits (as written when shorter)."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if isinstance(value, bool) else "none"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(value) if len(repr(value)) <= 7 else (f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}")
    return str(value)


def pick(data, *pairs: tuple[str, str]) -> list[str]:
    """``label value`` for each (label, path) whose value is a number or a boolean in ``data``."""
    return [
        f"{label} {fmt(v)}"
        for label, path in pairs
        if isinstance(v := get(data, path), (int, float, bool)) and v is not None
    ]


def named_values(mapping, key: str, limit: int = 4, label: str = "") -> list[str]:
    """``name: value`` for the first ``limit`` entries of ``mapping`` (a dict of dicts) that hold ``key``."""
    if not isinstance(mapping, dict):
        return []
    out = [
        f"{name}: {fmt(get(entry, key))}"
        for name, entry in mapping.items()
        if isinstance(get(entry, key), (int, float))
    ]
    more = f" (+{len(out) - limit} more)" if len(out) > limit else ""
    return [f"{label}{'; '.join(out[:limit])}{more}"] if out else []


# ----------------------------------------------------------------------------- headline figures
def headline(rel: str, d: dict) -> str:
    """The file's headline: a few figures read from it, labelled."""
    parts: list[str] = []
    name = Path(rel).name
    if isinstance(d.get("headline"), dict):  # a result that names its own headline figures
        parts = [f"{k.replace('_', ' ')} {fmt(v)}" for k, v in d["headline"].items()]
    elif get(d, "scores.averaged") is not None:  # a train_multi30k.py run
        parts = pick(
            d,
            ("val BLEU", "scores.averaged.val_beam5.bleu"),
            ("test 2016 BLEU", "scores.averaged.test_2016_beam5.bleu"),
        )
        parts = [", ".join(parts) + " (beam 5, averaged weights)"] if parts else []
        parts += pick(d, ("steps", "steps"), ("target tokens/s", "target_tokens_per_s"))
    elif "members" in d and isinstance(d.get("scores"), dict):  # an ensemble
        parts = pick(d, ("val BLEU", "scores.val_beam5.bleu"), ("test 2016 BLEU", "scores.test_2016_beam5.bleu"))
        parts += pick(d, ("alpha", "decode.alpha"))
        parts.append(f"{len(d['members'])} members")
    elif isinstance(d.get("stopped"), str):
        last = get(d, "bleu_vs_minutes.-1", {})
        parts = ["stopped early"] + pick(last, ("at minute", "minutes"), ("val greedy BLEU", "val_bleu_greedy_300"))
    elif "chosen" in d and "test_2016" in d:  # tune_decoding.py
        parts = pick(
            d,
            ("chosen on val: beam", "chosen.beam"),
            ("alpha", "chosen.alpha"),
            ("val BLEU", "chosen.val_bleu"),
            ("test 2016 BLEU", "test_2016.bleu"),
        )
    elif "scores" in d and get(d, "scores.test_2016_beam5.bleu_papers_form.bleu") is not None:  # rescore_bleu.py
        parts = pick(
            d,
            ("test 2016 sacreBLEU", "scores.test_2016_beam5.bleu"),
            ("papers' form", "scores.test_2016_beam5.bleu_papers_form.bleu"),
        )
    elif isinstance(d.get("results"), dict) and "sentences" in d and "translations" in d:  # significance.py
        parts = named_values(d["results"], "bleu", label="BLEU ")
        parts += named_values(
            {k: v for k, v in d["results"].items() if "p_bootstrap" in v},
            "p_bootstrap",
            label="p (bootstrap, vs the first) ",
        )
    elif isinstance(d.get("candidates"), dict):  # recipe_sweep.py --collect
        parts = named_values(d["candidates"], "val_bleu_beam5", label="val BLEU ")
    elif isinstance(d.get("rows"), dict) and "recipe_steps" in d:  # step_matched_sweep.py
        parts = pick(d, ("steps", "recipe_steps")) + named_values(d["rows"], "val_bleu", label="val BLEU ")
    elif isinstance(d.get("rows"), dict):  # an unscored sweep
        parts = named_values(d["rows"], "last_logged_train_loss", label="last train loss ")
    elif "beam_top_val_bleu" in d:  # rerank_nbest.py
        parts = pick(
            d,
            ("beam's top, val BLEU", "beam_top_val_bleu"),
            ("reranked without the channel, val BLEU", "chosen_without_channel.val_bleu"),
            ("its test 2016 BLEU", "chosen_without_channel.test_2016.bleu"),
            ("MBR val BLEU", "mbr_val_bleu"),
        )
    elif "single_runs_val_bleu" in d:
        best = max(
            (r for r in d.get("rows", []) if isinstance(r.get("val_bleu"), (int, float))),
            key=lambda r: r["val_bleu"],
            default=None,
        )
        parts = [f"best ensemble's val BLEU {fmt(best['val_bleu'])} ({len(best['members'])} members)"] if best else []
    elif isinstance(d.get("val_bleu"), list):
        rows = [r for r in d["val_bleu"] if isinstance(r, dict) and isinstance(r.get("bleu"), (int, float))]
        best = max(rows, key=lambda r: r["bleu"], default=None)
        parts = [f"{len(rows)} settings; best val BLEU {fmt(best['bleu'])} ({best.get('options')})"] if best else []
    elif "final_validation" in d:  # train_lm.py --minutes
        parts = pick(
            d,
            ("validation nats/char", "final_validation.whole_split.nats_per_char"),
            ("best weights' validation nats/char", "best_validation.whole_split.nats_per_char"),
            ("train tokens/s", "train_tokens_per_s"),
            ("steps", "steps"),
        )
    elif "ratio_qkv_over_hf_median" in d:  # train_lm.py --compare
        parts = pick(
            d,
            ("qkv tokens/s", "tokens_per_s_median.qkv"),
            ("HF tokens/s", "tokens_per_s_median.hf"),
            ("qkv / HF", "ratio_qkv_over_hf_median"),
        )
    elif d.get("benchmark") == "qkv demo" or name == "demo_time.json":
        runs = d.get("runs", [])
        parts = [
            f"run {i + 1}: {fmt(r.get('wall_seconds'))} s, exact match {fmt(r.get('exact_match'))}"
            for i, r in enumerate(runs)
        ]
    elif "tokens_per_s_median" in d and "two_processes_vs_two_threads" in d:  # distributed.py
        parts = [f"tokens/s {mode}: {fmt(v)}" for mode, v in d["tokens_per_s_median"].items()]
        parts += pick(d, ("2 processes / 2 threads", "two_processes_vs_two_threads"))
    elif isinstance(d.get("test"), dict) and "exact_match" in d["test"]:
        parts = pick(d, ("test exact match", "test.exact_match"), ("test BLEU", "test.bleu"))
    elif "top_heads" in d:  # explorer_compare.py
        top = get(d, "top_heads.0", {})
        parts = (
            [
                f"most different head: layer {top.get('layer')} head {top.get('head')}, "
                f"difference {fmt(top.get('difference'))}"
            ]
            if top
            else []
        )
        parts += pick(d, ("mean difference, all heads", "mean_difference_all_heads"))
    elif "packed" in d and "page" in d:  # explorer_draw.py
        parts = pick(
            d,
            ("page MB", "packed.page_mb"),
            ("first draw ms", "packed.load.first_draw_ms"),
            ("plain page's first draw ms", "plain.load.first_draw_ms"),
        )
    elif "experiment" in d:  # qkv experiment
        claims = d.get("claims") or {}
        held = sum(1 for v in claims.values() if v is True)
        parts = [f"{held} of {len(claims)} claims held"] if claims else []
        parts += [line.strip() for line in (d.get("summary") or [])[:1] if isinstance(line, str)]
    elif name.startswith("cuda_checks"):
        runs = {k: v for k, v in d.items() if isinstance(v, dict) and "qkv demo --device cuda" in v}
        if "qkv demo --device cuda" in d:
            runs = {"run": d}
        parts = [
            f"{k}: demo exact match {fmt(get(v, 'qkv demo --device cuda.exact_match'))} in "
            f"{fmt(get(v, 'qkv demo --device cuda.total_seconds'))} s"
            for k, v in list(runs.items())[-2:]
        ]
    elif d.get("suite") in ("attention",) and isinstance(d.get("results"), list):
        parts = attention_headline(d["results"])
    elif isinstance(d.get("ratios"), dict) and "suite" in d:  # qkv bench training/decoding/precision
        parts = [f"{k} {fmt(v)}" for k, v in list(d["ratios"].items())[:3] if isinstance(v, (int, float))]
    elif "bleu_change_bf16_minus_fp32" in d:  # precision_bleu.py
        parts = pick(
            d,
            ("BLEU change bf16 - fp32", "bleu_change_bf16_minus_fp32"),
            ("sequential speed-up bf16", "sequential_speedup_bf16"),
        )
    elif isinstance(d.get("splits"), dict) and "pair" in d:  # length_ratios.py
        parts = [
            f"{s}: translation/reference words {fmt(v.get('translation_per_reference_word'))}"
            for s, v in d["splits"].items()
            if isinstance(v, dict) and "translation_per_reference_word" in v
        ]
    elif isinstance(d.get("summary"), dict) and "corpora" in d:  # paper_scale.py
        parts = [f"prepare pairs/s {k}: {fmt(v)}" for k, v in (get(d, "summary.prepare_pairs_per_s") or {}).items()]
        parts += pick(d, ("RSS within 10% met", "summary.rss_target_within_10_percent_met"))
    elif "seconds_first" in d:  # verify_prepared.py
        parts = pick(
            d,
            ("pairs", "folder.pairs"),
            ("MiB/s first", "mib_per_s_first"),
            ("peak RSS added MiB", "peak_rss_added_mib"),
        )
        if isinstance(d.get("seconds_cached"), list) and d["seconds_cached"]:
            parts.append(f"cached check {fmt(min(d['seconds_cached']))} s (fastest)")
    elif "languages" in d:  # cached_encoder.py
        parts = [
            f"{lang}: {fmt(get(v, 'latin_fast_path.warm_sentences_per_s'))} sentences/s warm "
            f"(tokenizer alone {fmt(get(v, 'tokenizer_s'))} s)"
            for lang, v in d["languages"].items()
        ]
    elif isinstance(d.get("ratios"), dict) and isinstance(d.get("results"), dict):  # cpu_step_paths.py
        parts = pick(d, ("today's step tokens/s", "results.today.tokens_per_s"))
        parts += [f"today / {k} {fmt(get(v, 'today_over_it'))}" for k, v in list(d["ratios"].items())[:3]]
    elif "loss_alone" in d:  # fused_loss.py
        parts = pick(
            d,
            ("loss alone, today / before", "loss_alone.today_over_before"),
            ("training step, today / before", "training_step.today_over_before"),
        )
    elif isinstance(d.get("results"), dict) and all(isinstance(v, dict) for v in d["results"].values()):
        parts = named_values(d["results"], "median_kept_over_default", label="heap top kept / default ")
    elif "all_flat" in d:  # memory.py
        parts = pick(d, ("all runs flat after warm-up", "all_flat"), ("minutes", "minutes"))
        parts.append(f"{len(d.get('runs', []))} runs")
    elif "ratio_today_over_before" in d:
        parts = pick(d, ("tokens/s today", "mean_tokens_per_s_today"), ("today / before", "ratio_today_over_before"))
    elif "ratio_side_by_side_over_one_process" in d:
        parts = pick(
            d,
            ("side by side tokens/s", "side_by_side_total_target_tokens_per_s"),
            ("side by side / one process", "ratio_side_by_side_over_one_process"),
        )
    elif isinstance(d.get("rows"), list) and d["rows"] and "steps_vs_recipe" in d["rows"][0]:
        parts = [f"{r.get('options')}: {fmt(r.get('steps_vs_recipe'))}x the recipe's steps" for r in d["rows"][:3]]
    elif isinstance(d.get("runs"), dict) and "common_minutes" in d:  # compare_runs.py
        parts = [
            f"{k}: {fmt(get(v, 'tokens_per_s_median'))} tokens/s, median RSS {fmt(get(v, 'rss_mb_median'))} MB"
            for k, v in d["runs"].items()
        ]
    elif "kills" in d:  # crash_consistency.py
        parts = pick(d, ("kills", "kills"), ("loadable and resumed exactly", "loadable_and_resumed_exactly"))
    elif "valid_requests_answered_200" in d:  # serve_load.py
        parts = pick(
            d,
            ("valid requests answered", "valid_requests_answered_200"),
            ("unanswered", "valid_requests_unanswered"),
            ("5xx other than 503", "server_errors_5xx_except_503"),
        )
    elif "grid" in d and "chosen" in d:
        parts = pick(d, ("chosen val BLEU", "chosen.val_bleu"))
    return "; ".join(p for p in parts if p) or "(no single figure: see the file)"


def attention_headline(results: list) -> list[str]:
    """The longest fp32 forward row with qkv's fast path and SDPA both timed: their times."""
    rows = [
        r
        for r in results
        if r.get("pass") == "forward" and get(r, "timings.qkv_fast.median_s") and get(r, "timings.torch_sdpa.median_s")
    ]
    if not rows:
        return [f"{len(results)} timed rows"]
    row = max(rows, key=lambda r: (r.get("dtype") == "float32", r.get("seq_len", 0)))
    fast, sdpa = get(row, "timings.qkv_fast.median_s"), get(row, "timings.torch_sdpa.median_s")
    return [
        f"s {row.get('seq_len')} {row.get('dtype')} forward: qkv fast path {fmt(fast * 1e3)} ms, "
        f"SDPA {fmt(sdpa * 1e3)} ms"
    ]


# ----------------------------------------------------------------------------- the other columns
def measures(d: dict) -> str:
    """What the file measures, in one line (its own words, shortened)."""
    for key in ("what", "benchmark", "task", "experiment", "suite"):
        text = d.get(key)
        if isinstance(text, str) and text.strip():
            text = " ".join(text.split())
            if key == "suite":
                text = f"qkv bench {text}"
            elif key == "experiment":
                text = f"qkv experiment {text}"
            if isinstance(d.get("train_minutes_budget"), (int, float)):
                text += f", {fmt(d['train_minutes_budget'])} minutes of training"
            return shorten(text, 150)
    if "chosen_on" in d:  # tune_decoding.py
        return shorten(
            f"decoding (weights, beam, length penalty) chosen on {d['chosen_on']} for a finished run, "
            f"test 2016 scored once with it: {Path(str(d.get('run_dir', ''))).name}",
            150,
        )
    if isinstance(d.get("splits"), dict) and "pair" in d:  # length_ratios.py
        return f"reference and translation lengths per split, {d['pair']}"
    if "top_heads" in d:  # explorer_compare.py
        return f"where two sentences' attention differs, head by head (qkv attend --compare, {d.get('model')})"
    return "(not stated in the file)"


def shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0].rstrip(",;:")
    return cut + " …"


def machine_text(m) -> str:
    if not isinstance(m, dict):
        return str(m)
    cpu = m.get("cpu_model", "unknown")
    family, model = m.get("cpu_family", "unknown"), m.get("cpu_model_number", "unknown")
    parts = [
        cpu
        + (
            f" (family {family}, model {model})"
            if family != "unknown" and model != "unknown"
            else f" (family {family})"
            if family != "unknown"
            else ""
        )
    ]
    for name in ("avx2", "avx512_bf16", "amx"):
        parts.append(name if m.get(name) is True else f"no {name}" if m.get(name) is False else f"{name} unknown")
    if isinstance(m.get("threads"), int):
        parts.append(f"{m['threads']} thread{'s' if m['threads'] != 1 else ''}")
    if m.get("gpu") not in (None, "unknown"):
        parts.append(str(m["gpu"]))
    if m.get("machine_named_in_file_name"):
        parts.append(f"named {m['machine_named_in_file_name']}")
    return ", ".join(p for p in parts if p)


def date_text(d: dict) -> str:
    date = str(d.get("date", "unknown"))
    source = d.get("date_source", "")
    if source.startswith("committed"):
        return f"{date[:10]} (committed)"
    return date[:19]


def commit_text(d: dict) -> str:
    commit = str(d.get("commit", "unknown"))
    if commit != "unknown":
        return commit[:10] + ("-dirty" if commit.endswith("-dirty") else "")
    added = d.get("committed_in")
    return f"unknown (added in {added[:7]})" if added else "unknown"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ----------------------------------------------------------------------------- the page
def render(results: Path = RESULTS) -> str:
    files = sorted(p for p in results.rglob("*.json"))
    groups: dict[str, list[Path]] = {}
    for path in files:
        folder = path.parent.relative_to(results).as_posix()
        groups.setdefault(folder, []).append(path)
    order = [f for f in FOLDERS if f in groups] + sorted(f for f in groups if f not in FOLDERS)
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/index.py` from the JSON files below; do not edit by hand "
        "(tests/test_benchmark_results.py fails when this page is stale). "
        "What each script measures and how to run it: [benchmarks/README.md](../README.md).",
        "",
        "Each JSON records `machine`, `command`, `date` and `commit`. For files written before these were "
        "recorded, `commit` is `unknown` (the commit a run used was never written down; the commit that "
        "added the file is shown instead), a date marked *(committed)* is the day the file was committed "
        "(the run is no later), and a flag is `unknown` where the file did not record it.",
        "",
        f"{len(files)} JSON files in {len(order)} folders.",
        "",
    ]
    lines += ["| Folder | Files | What |", "|---|---|---|"]
    lines += [f"| [{f}/](#{anchor(f)}) | {len(groups[f])} | {cell(FOLDERS.get(f, ''))} |" for f in order]
    for folder in order:
        lines += ["", f"## {folder}/", ""]
        if folder in FOLDERS:
            lines += [FOLDERS[folder], ""]
        lines += ["| File | What it measures | Headline | Machine | Date | Commit |", "|---|---|---|---|---|---|"]
        for path in groups[folder]:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
            rel = path.relative_to(results).as_posix()
            figure = f" (figure: `{path.with_suffix('.png').name}`)" if path.with_suffix(".png").exists() else ""
            lines.append(
                "| "
                + " | ".join(
                    cell(x)
                    for x in (
                        f"`{path.name}`",
                        measures(data),
                        headline(rel, data) + figure,
                        machine_text(data.get("machine")),
                        date_text(data),
                        commit_text(data),
                    )
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def anchor(folder: str) -> str:
    """GitHub's heading anchor for ``## folder/``."""
    return "".join(c for c in f"{folder}/".lower().replace(" ", "-") if c.isalnum() or c in "-_")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if INDEX.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        stale = not INDEX.exists() or INDEX.read_text() != text
        print(f"{INDEX}: {'stale: run python benchmarks/index.py' if stale else 'up to date'}")
        return 1 if stale else 0
    INDEX.write_text(text)
    print(f"wrote {INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
