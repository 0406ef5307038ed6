"""Speed and resident memory of training runs side by side, read from their ``metrics.jsonl``.

Every training run logs, every ``--log-every-steps`` steps, the step it reached, its minutes, the
target tokens per second since the last record and the process's resident memory (``rss_mb``). This
gathers two or more such runs into one table per window of ``--window`` minutes: the step reached at
the window's end, the median tokens/s and the median and largest RSS inside it; and the ratios of each
run to the first over the minutes all of them trained. Use it for runs that differ in one setting and
ran one after the other on the same, otherwise idle machine (the JSON names this machine; say in
``--note`` if the runs were elsewhere).

    python benchmarks/compare_runs.py --run "oneDNN cache 8=runs/a/metrics.jsonl" \\
        --run "oneDNN cache 1024=runs/b/metrics.jsonl" --out benchmarks/results/performance/compare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment


def read_train_records(path: Path) -> list[dict]:
    """The ``"train"`` records of a run's metrics.jsonl, in order (a torn last line is skipped)."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == "train" and "tokens_per_s" in record:
            records.append(record)
    if not records:
        raise ValueError(f"{path}: no training records (is it a run's metrics.jsonl?)")
    return records


def windows(records: list[dict], minutes: float, until: float) -> list[dict]:
    """Per window of ``minutes`` up to ``until``: the step reached, median tokens/s, median/max RSS."""
    out, start = [], 0.0
    while start < until - 1e-9:
        end = min(start + minutes, until)
        inside = [r for r in records if start < r["minutes"] <= end]
        if inside:
            rss = [r["rss_mb"] for r in inside if r.get("rss_mb") is not None]
            out.append(
                {
                    "minutes": [round(start, 2), round(end, 2)],
                    "step": inside[-1]["step"],
                    "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in inside), 1),
                    "rss_mb_median": round(statistics.median(rss), 1) if rss else None,
                    "rss_mb_max": max(rss) if rss else None,
                }
            )
        start = end
    return out


def step_at(records: list[dict], minutes: float) -> int:
    """The last step logged at or before ``minutes``."""
    return max((r["step"] for r in records if r["minutes"] <= minutes), default=0)


def compare(runs: dict[str, list[dict]], window: float) -> dict:
    """The table for ``{label: train records}``; ratios are each run over the first one."""
    common = min(records[-1]["minutes"] for records in runs.values())
    first_label = next(iter(runs))
    table = {}
    for label, records in runs.items():
        shared = [r for r in records if r["minutes"] <= common]
        rss = [r["rss_mb"] for r in shared if r.get("rss_mb") is not None]
        table[label] = {
            "minutes_logged": records[-1]["minutes"],
            "step_at_common_minutes": step_at(records, common),
            "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in shared), 1),
            "rss_mb_median": round(statistics.median(rss), 1) if rss else None,
            "rss_mb_max": max(rss) if rss else None,
            "windows": windows(records, window, common),
        }
    base = table[first_label]
    for row in table.values():
        row["steps_ratio"] = round(row["step_at_common_minutes"] / max(1, base["step_at_common_minutes"]), 3)
        row["tokens_per_s_ratio"] = round(row["tokens_per_s_median"] / base["tokens_per_s_median"], 3)
    return {"common_minutes": round(common, 2), "reference": first_label, "runs": table}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="LABEL=METRICS_JSONL",
        help="a run's label and its metrics.jsonl (two or more; the first is the reference)",
    )
    p.add_argument("--window", type=float, default=6.0, help="minutes per row of the table")
    p.add_argument("--note", default="", help="a remark stored in the JSON (how and where the runs ran)")
    add_result_options(p, required=True)
    args = p.parse_args(argv)
    check_result_file(p, args)  # before any work
    if args.window <= 0:
        p.error("--window must be positive")
    runs = {}
    for item in args.run:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            p.error(f"--run takes LABEL=PATH, got {item!r}")
        if label in runs:
            p.error(f"two runs labelled {label!r}")
        try:
            runs[label] = read_train_records(Path(path))
        except (OSError, ValueError) as err:
            p.error(str(err))
    if len(runs) < 2:
        p.error("give at least two --run")
    report = {
        "benchmark": "training speed and resident memory of runs side by side (from their metrics.jsonl)",
        "command": " ".join(["python"] + sys.argv),
        "sources": dict(item.partition("=")[::2] for item in args.run),
        "note": args.note,
        **compare(runs, args.window),
        "machine": environment(),
    }
    write_result(args.out, report)
    for label, row in report["runs"].items():
        print(
            f"{label}: step {row['step_at_common_minutes']} at {report['common_minutes']} min "
            f"(x{row['steps_ratio']}), {row['tokens_per_s_median']} tokens/s (x{row['tokens_per_s_ratio']}), "
            f"RSS median {row['rss_mb_median']} MB, max {row['rss_mb_max']} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
