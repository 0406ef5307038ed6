"""How long checking a prepared folder against its manifest takes (``PreparedCorpus.verify``: every
array's SHA-256, offsets, lengths and ids), the first time and when the hashes cached in the
folder's ``verified.json`` stand, and how much memory it adds.

Either on a folder you have (``--prepared DIR``), or on a WMT 2014-sized corpus it makes
(``--pairs 4500000``: ``benchmarks/make_wmt_like.py`` then ``qkv prepare --workers 2`` into
``--scratch``, which is never committed; about 8 minutes on 2 cores)::

    python benchmarks/studies/verify_prepared.py --pairs 4500000 --scratch /tmp/verify_bench
    # writes benchmarks/results/paper-scale/verify_prepared.json

"First" times are with the files in the page cache (this script cannot drop it); the cache file
is deleted before each of them.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_folder(pairs: int, scratch: Path) -> tuple[Path, dict]:
    """Generate a WMT-like corpus of ``pairs`` and prepare it; returns the folder and the seconds spent."""
    text, prepared = scratch / f"wmt_{pairs}", scratch / f"prepared_{pairs}"
    seconds = {}
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "make_wmt_like.py"),
            "--pairs",
            str(pairs),
            "--out",
            str(text),
            "--overwrite",
        ],
        check=True,
    )
    seconds["generate"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "qkv",
            "prepare",
            "--train-src",
            str(text / "train.en"),
            "--train-tgt",
            str(text / "train.de"),
            "--val-src",
            str(text / "valid.en"),
            "--val-tgt",
            str(text / "valid.de"),
            "--out",
            str(prepared),
            "--workers",
            "2",
            "--overwrite",
            "--no-progress",
        ],
        check=True,
    )
    seconds["prepare"] = round(time.perf_counter() - start, 1)
    return prepared, seconds


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    from qkv.bench.results import add_result_options, check_result_file
    from qkv.bench.timing import environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--prepared", help="a folder made by qkv prepare")
    where.add_argument("--pairs", type=int, help="make a WMT-like corpus of this many pairs and prepare it")
    parser.add_argument("--scratch", default="/tmp/verify_bench", help="where --pairs writes its corpus and folder")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each kind")
    add_result_options(parser, "benchmarks/results/paper-scale/verify_prepared.json")
    args = parser.parse_args()
    out = check_result_file(parser, args)  # before any work

    from qkv.bench.provenance import write_result
    from qkv.data.prepared import CACHE_FILE, PreparedCorpus

    made = {}
    folder = Path(args.prepared) if args.prepared else None
    if folder is None:
        folder, made = make_folder(args.pairs, Path(args.scratch))
    files = [p for p in folder.iterdir() if p.is_file() and p.name != CACHE_FILE]
    mib = sum(p.stat().st_size for p in files) / 2**20
    corpus = PreparedCorpus(folder)
    rss_before = peak_rss_mib()
    first, cached = [], []
    for _ in range(args.repeats):
        (folder / CACHE_FILE).unlink(missing_ok=True)
        start = time.perf_counter()
        corpus.verify()
        first.append(round(time.perf_counter() - start, 3))
        start = time.perf_counter()
        corpus.verify()
        cached.append(round(time.perf_counter() - start, 3))
        print(f"first {first[-1]} s, cached {cached[-1]} s", flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    result = {
        "what": "PreparedCorpus.verify on a prepared folder: every array's SHA-256, offsets, lengths and ids; "
        "'first' with no verified.json (files in the page cache), 'cached' with it",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit.strip() or None,
        "machine": environment(),
        "folder": {"pairs": len(corpus.split("train")), "mib": round(mib, 1), "files": len(files)},
        "made": made,
        "seconds_first": first,
        "seconds_cached": cached,
        "mib_per_s_first": round(mib / min(first), 1),
        "peak_rss_added_mib": round(peak_rss_mib() - rss_before, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("folder", "seconds_first", "seconds_cached", "mib_per_s_first", "peak_rss_added_mib")
            }
        )
    )


if __name__ == "__main__":
    main()
