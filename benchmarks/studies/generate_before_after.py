"""Issue 66 item 4: does moving sampling to qkv.models.sampling and the stop texts to
qkv.inference.generation change the speed of generation? The same generation (the v0.1 fixture
language model, 400 sampled tokens, two stop texts that never occur) timed with the code before the
change (a worktree, PYTHONPATH) and after it, alternating in fresh processes pinned to one core.

    python benchmarks/studies/generate_before_after.py --before /tmp/h9-before/src --rounds 5 --overwrite
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "fixtures" / "runs_v0_1" / "lm_run"
OUT = ROOT / "benchmarks" / "results" / "language-model" / "generate_before_after.json"

# what qkv generate and qkv serve run per request: the old code had no qkv.inference
TIMED = f"""
import time, torch
torch.set_num_threads(1)
from qkv.runs.folder import load_run
model, tokenizer, _ = load_run({str(RUN)!r})
ids = tokenizer.encode("ROMEO:")
try:
    from qkv.inference.generation import SamplingConfig, generate_texts
    def once():
        g = torch.Generator().manual_seed(0)
        return generate_texts(model, tokenizer, ids, SamplingConfig(400, stop=("@@@", "###")), generator=g)[0].text
except ImportError:
    from qkv.serve.streaming import TextStream
    def once():
        g = torch.Generator().manual_seed(0)
        stream = TextStream(tokenizer, ["@@@", "###"])
        model.generate(torch.tensor([ids]), 400, generator=g, on_step=lambda new: stream.add(int(new[0])) and False)
        return stream.text
once()
best = []
for _ in range(5):
    start = time.perf_counter(); text = once(); best.append(time.perf_counter() - start)
print(min(best), len(text))
"""


def measure(src: str) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", TIMED], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    seconds, chars = out.stdout.split()
    return float(seconds), int(chars)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="the src/ folder of the code before the change")
    parser.add_argument("--rounds", type=int, default=7)
    sys.path.insert(0, str(ROOT / "src"))
    from qkv.bench.provenance import write_result
    from qkv.bench.results import add_result_options, check_result_file

    add_result_options(parser, OUT)
    args = parser.parse_args()
    out = check_result_file(parser, args)

    before, after, texts = [], [], set()
    for _ in range(args.rounds):
        for where, into in ((args.before, before), (str(ROOT / "src"), after)):
            seconds, chars = measure(where)
            into.append(seconds)
            texts.add(chars)
    report = {
        "benchmark": "qkv generate's sampling and stop texts, before and after qkv.inference (issue 66 item 4)",
        "setup": "v0.1 fixture LM, 400 sampled tokens, 2 stop texts never met, 1 core, best of 5 per process",
        "rounds": args.rounds,
        "before_s": before,
        "after_s": after,
        "median_before_s": statistics.median(before),
        "median_after_s": statistics.median(after),
        "after_over_before": statistics.median(after) / statistics.median(before),
        "same_text_length": len(texts) == 1,
        "machine": {"threads": 1},
        "command": " ".join(["python", *sys.argv]),
        "base_commit_before": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    write_result(out, report)
    print(json.dumps({k: report[k] for k in ("median_before_s", "median_after_s", "after_over_before")}))


if __name__ == "__main__":
    main()
