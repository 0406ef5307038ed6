"""Time ``qkv demo`` end to end (a fresh process: imports, data, training, evaluation, heatmaps).

    python benchmarks/demo_time.py --out benchmarks/results/demo/demo_time.json [--runs 3]

The goal (issue 3): >= 99% exact match on held-out generated dates within 3 minutes of wall time
on a 2-core CPU. The JSON records, for each run, the wall time of the whole command, the
training time and steps, the held-out exact match, and the load average before and after (other
processes sharing the CPU slow the demo down; a load above the core count means they did).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1)
    add_result_options(p, REPO / "benchmarks" / "results" / "demo" / "demo_time.json")
    p.add_argument("--demo-args", default="", help="extra arguments for qkv demo, e.g. '--threads 2'")
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    check_result_file(p, args)  # before minutes of demos, not after
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="qkv-demo-") as folder:
            command = [
                sys.executable,
                "-c",
                "import sys; from qkv.cli import main; sys.exit(main())",
                "demo",
                "--out",
                folder,
                "--no-progress",
                *args.demo_args.split(),
            ]
            load_before = os.getloadavg()
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                raise SystemExit(f"qkv demo failed with exit code {done.returncode}")
            summary = json.loads((Path(folder) / "summary.json").read_text())
            heatmaps = len(list((Path(folder) / "heatmaps").glob("*.png")))
        run = {
            "wall_seconds": round(wall, 1),
            "exact_match": summary["exact_match"],
            "steps": summary["steps"],
            "train_seconds": summary["train_seconds"],
            "stopped_early": summary["stopped_early"],
            "heatmaps": heatmaps,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "goal_met": summary["exact_match"] >= 0.99 and wall <= 180,
        }
        runs.append(run)
        print(json.dumps(run), flush=True)
    report = {
        "benchmark": "qkv demo wall time (goal: >= 99% held-out exact match within 180 s)",
        "command": " ".join(["python"] + sys.argv),
        "runs": runs,
        # the CPU's model, family and bf16 units, as every other benchmark records them (the demo itself ran
        # in the child processes above, with their own thread count: --demo-args)
        "machine": environment(),
    }
    print(f"wrote {write_result(args.out, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
