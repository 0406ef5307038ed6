"""Crash consistency of training runs: SIGKILL at random moments, 10 kills per run (see
tests/crash_trials.py for the procedure). Writes benchmarks/results/reliability/crash_consistency.json.

    python benchmarks/crash_consistency.py --chains 10          # 100 kills (the README's figure)
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import crash_trials  # noqa: E402
import torch  # noqa: E402

from qkv.bench import timing
from qkv.bench.provenance import write_result  # noqa: E402
from qkv.bench.results import add_result_options, check_result_file  # noqa: E402
from qkv.bench.timing import environment  # noqa: E402


def cpu_flags() -> dict:
    flags = timing.cpu_flags()
    return {"avx2": "avx2" in flags, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=10, help="runs, each killed --kills times (default 10)")
    parser.add_argument("--kills", type=int, default=10, help="kills per run (default 10)")
    add_result_options(parser, "benchmarks/results/reliability/crash_consistency.json")
    args = parser.parse_args()
    check_result_file(parser, args)  # before any work
    torch.set_num_threads(1)
    start = time.time()
    load_before = os.getloadavg()
    kills, chains_equal = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src, tgt = crash_trials.write_data(root / "data")
        expected = crash_trials.uninterrupted(root, src, tgt)
        for chain in range(args.chains):
            folder = root / f"chain{chain}"
            folder.mkdir()
            report = crash_trials.run_chain(
                folder, src, tgt, expected, args.kills, seed=1000 + chain, log=lambda k: print(k, flush=True)
            )
            kills += report.kills
            chains_equal.append(report.chain_final_equal)
    ok = [k for k in kills if k.translate_ok and k.resumed_equal]
    result = {
        "benchmark": "SIGKILL at random moments of qkv train (checkpoint every step, tiny model, "
        f"{crash_trials.STEPS} steps); after each kill: qkv translate loads the run, --resume "
        "finishes a copy, final weights compared bit for bit with an uninterrupted run",
        "command": " ".join(["python", *sys.argv]),
        "kills": len(kills),
        "loadable_and_resumed_exactly": len(ok),
        "chains_finished_exactly": f"{sum(chains_equal)}/{len(chains_equal)}",
        "kill_moments": dict(collections.Counter(k.moment for k in kills)),
        "steps_at_kill": [k.step for k in kills],
        "trials": [asdict(k) for k in kills],
        "minutes": round((time.time() - start) / 60, 1),
        "machine": {
            **environment(),
            **cpu_flags(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "platform": platform.platform(),
        },
    }
    write_result(args.out, result)
    print(f"{len(ok)}/{len(kills)} kills: loadable and resumed exactly; moments {result['kill_moments']}")
    return 0 if len(ok) == len(kills) and all(chains_equal) else 1


if __name__ == "__main__":
    sys.exit(main())
