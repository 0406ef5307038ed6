"""The scale test of the paper-scale issue: ``qkv prepare`` and a 2-process ``qkv train --prepared``
on generated corpora of 0.5M and 4.5M sentence pairs with WMT 2014 En-De-like length statistics
(benchmarks/make_wmt_like.py, written to a scratch folder, never committed).

For each corpus size:

1. ``qkv prepare --workers 2`` (a new 8k BPE learned on the default sample): wall time, pairs/s,
   the seconds of each phase (from the manifest), the peak memory of the whole process tree
   (sampled every 0.1 s: the parent's and its workers' PSS summed, so pages a forked worker shares
   with the parent count once) and the peak RSS of its largest process, the
   prepared folder's size, the bad lines reported;
2. ``python -m torch.distributed.run --standalone --nproc_per_node 2`` of ``qkv train --prepared``
   for ``--steps`` steps of a small model (stated in the JSON), each rank's peak resident memory
   (``VmHWM`` in /proc/self/status, read by the rank itself when ``qkv train`` returns: this script
   runs each rank as ``paper_scale.py rank DIR -- train ...``, which calls ``qkv.cli.main``).

Targets (the issue's): prepare >= 20k pairs/s on 2 cores; each training process's peak RSS at 4.5M
pairs within 10% of its peak at 0.5M.

    nohup python benchmarks/paper_scale.py > /tmp/bench/paper_scale.log 2>&1 &
    # writes benchmarks/results/paper-scale/paper_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--d-model", "128", "--heads", "4", "--encoder-layers", "2", "--decoder-layers", "2", "--d-ff", "512"]


def status_kib(field: str, pid: str = "self") -> int | None:
    """A ``kB`` field of /proc/PID/status (VmHWM: peak resident memory; VmRSS: now)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def pss_kib(pid: str) -> int:
    """Proportional set size: resident memory with each page shared by N processes counted 1/N
    (forked workers share the parent's pages; summing their RSS would count those N times)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kib(root: int) -> tuple[int, int]:
    """Memory of ``root`` and all its descendants: (summed PSS, largest process's RSS)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, largest, stack = 0, 0, [root]
    while stack:
        pid = stack.pop()
        total, largest = total + pss_kib(str(pid)), max(largest, status_kib("VmRSS", str(pid)) or 0)
        stack.extend(children.get(pid, []))
    return total, largest


def run_watched(command: list[str], log: Path) -> dict:
    """Run ``command``, sampling its process tree's resident memory every 0.1 s."""
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        peak_total = peak_largest = 0
        while process.poll() is None:
            total, largest = tree_rss_kib(process.pid)
            peak_total, peak_largest = max(peak_total, total), max(peak_largest, largest)
            time.sleep(0.1)
    seconds = time.perf_counter() - start
    if process.returncode:
        raise RuntimeError(
            f"{' '.join(command)} exited with {process.returncode}; see {log}:\n" + log.read_text()[-3000:]
        )
    return {
        "seconds": round(seconds, 2),
        "peak_pss_tree_mib": round(peak_total / 1024, 1),
        "peak_rss_largest_process_mib": round(peak_largest / 1024, 1),
    }


def folder_mib(folder: Path) -> float:
    return round(sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 2**20, 1)


def generate(pairs: int, folder: Path) -> dict:
    done = folder / "done.json"
    if done.is_file() and json.loads(done.read_text()).get("pairs") == pairs:
        return json.loads(done.read_text())
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "make_wmt_like.py"),
            "--pairs",
            str(pairs),
            "--out",
            str(folder),
            "--overwrite",
        ],
        check=True,
    )  # its own scratch folder: a killed generation is redone
    info = {
        "pairs": pairs,
        "seconds": round(time.perf_counter() - start, 1),
        "train_mib": round(sum((folder / f"train.{x}").stat().st_size for x in ("en", "de")) / 2**20, 1),
    }
    done.write_text(json.dumps(info))
    return info


def prepare(corpus: Path, out: Path, logs: Path, workers: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "qkv",
        "prepare",
        "--train-src",
        str(corpus / "train.en"),
        "--train-tgt",
        str(corpus / "train.de"),
        "--val-src",
        str(corpus / "valid.en"),
        "--val-tgt",
        str(corpus / "valid.de"),
        "--out",
        str(out),
        "--workers",
        str(workers),
        "--overwrite",
        "--no-progress",
    ]
    load_before = os.getloadavg()
    measured = run_watched(command, logs / f"prepare-{out.name}.log")
    manifest = json.loads((out / "manifest.json").read_text())
    lines = manifest["lines"]["train"]
    return {
        "command": " ".join(["qkv", *command[3:]]),
        "workers": workers,
        **measured,
        "pairs_per_s": round(lines / measured["seconds"]),
        "tokenize_pairs_per_s": round(lines / manifest["seconds"]["tokenize"]),
        "phase_seconds": manifest["seconds"],
        "train_pairs_kept": manifest["splits"]["train"]["pairs"],
        "dropped": manifest["dropped"]["train"],
        "first_dropped": manifest["dropped_first"]["train"][:3],
        "vocab_size": manifest["vocab_size"],
        "tokenizer_source": manifest["tokenizer_source"],
        "folder_mib": folder_mib(out),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def train(prepared: Path, run_dir: Path, logs: Path, steps: int, max_tokens: int) -> dict:
    rss_dir = logs / f"rss-{run_dir.name}"
    rss_dir.mkdir(parents=True, exist_ok=True)
    for old in rss_dir.glob("rank*.json"):
        old.unlink()
    train_args = [
        "train",
        "--prepared",
        str(prepared),
        "--run-dir",
        str(run_dir),
        "--overwrite",
        *MODEL,
        "--max-tokens",
        str(max_tokens),
        "--max-steps",
        str(steps),
        "--minutes",
        "0",
        "--no-bf16",
        "--eval-every-minutes",
        "0",
        "--checkpoint-every-minutes",
        "0",
        "--no-progress",
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(Path(__file__).resolve()),
        "rank",
        str(rss_dir),
        "--",
        *train_args,
    ]
    load_before = os.getloadavg()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    measured = run_watched(command, logs / f"train-{run_dir.name}.log")
    ranks = [json.loads((rss_dir / f"rank{r}.json").read_text()) for r in range(2)]
    path = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    trained = [m for m in metrics if m.get("event") == "train"]
    return {
        "command": "torchrun --standalone --nproc_per_node 2 -m qkv " + " ".join(train_args),
        "omp_num_threads": env_threads or "1 (torchrun's default)",
        **measured,
        "steps": trained[-1]["step"] if trained else None,
        "target_tokens_per_s_last": trained[-1]["tokens_per_s"] if trained else None,
        "loss_first_last": [trained[0]["loss"], trained[-1]["loss"]] if trained else None,
        "ranks": ranks,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def rank_main(rss_dir: str, argv: list[str]) -> int:
    """One rank: ``qkv`` with ``argv``, then this process's peak and final resident memory."""
    from qkv.cli import main

    code = main(argv)
    rank = os.environ.get("RANK", "0")
    Path(rss_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": int(rank),
                "exit_code": code,
                "peak_rss_mib": round((status_kib("VmHWM") or 0) / 1024, 1),
                "final_rss_mib": round((status_kib("VmRSS") or 0) / 1024, 1),
            }
        )
    )
    return code


def cpu_flags() -> dict:
    from qkv.bench import timing

    flags = timing.cpu_flags()
    return {name: name in flags for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rank":
        return rank_main(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    from qkv.bench.results import add_result_options, check_result_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500_000, 4_500_000])
    parser.add_argument("--work", default="/tmp/bench/paper_scale", help="scratch folder (corpora, prepared, runs)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per corpus")
    parser.add_argument("--max-tokens", type=int, default=2000, help="padded tokens per batch and process")
    parser.add_argument("--workers", type=int, default=2)
    add_result_options(parser, ROOT / "benchmarks" / "results" / "paper-scale" / "paper_scale.json")
    args = parser.parse_args(argv)
    check_result_file(parser, args)  # before any work
    from qkv.bench.provenance import write_result
    from qkv.bench.timing import environment

    work = Path(args.work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result = {
        "what": "qkv prepare (2 workers) and a 2-process qkv train --prepared on generated WMT-like corpora",
        "environment": {**environment(), **cpu_flags()},
        "model": "d_model 128, 4 heads, 2+2 layers, d_ff 512, shared 8k BPE; float32; "
        f"{args.max_tokens} padded tokens a batch a process, accum 1, validation off",
        "corpora": {},
    }
    for size in args.sizes:
        name = f"{size // 1000}k"
        entry = result["corpora"][name] = {"generated": generate(size, work / f"wmt_{name}")}
        print(f"[{name}] generated {entry['generated']}", flush=True)
        entry["prepare"] = prepare(work / f"wmt_{name}", work / f"prepared_{name}", logs, args.workers)
        print(f"[{name}] prepare {json.dumps(entry['prepare'])}", flush=True)
        entry["train"] = train(work / f"prepared_{name}", work / f"run_{name}", logs, args.steps, args.max_tokens)
        print(f"[{name}] train {json.dumps(entry['train'])}", flush=True)
        write_result(Path(args.out), result)  # what is measured so far
    names = list(result["corpora"])
    if len(names) >= 2:
        small, large = (result["corpora"][n]["train"]["ranks"] for n in (names[0], names[-1]))
        ratios = [round(b["peak_rss_mib"] / a["peak_rss_mib"], 3) for a, b in zip(small, large)]
        result["summary"] = {
            "prepare_pairs_per_s": {n: result["corpora"][n]["prepare"]["pairs_per_s"] for n in names},
            "prepare_target_20k_pairs_per_s_met": {
                n: result["corpora"][n]["prepare"]["pairs_per_s"] >= 20_000 for n in names
            },
            "train_peak_rss_mib_per_rank": {
                n: [r["peak_rss_mib"] for r in result["corpora"][n]["train"]["ranks"]] for n in names
            },
            f"peak_rss_ratio_{names[-1]}_over_{names[0]}_per_rank": ratios,
            "rss_target_within_10_percent_met": all(abs(r - 1) <= 0.10 for r in ratios),
        }
    result["environment"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result(Path(args.out), result)
    print(json.dumps(result.get("summary", {}), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
