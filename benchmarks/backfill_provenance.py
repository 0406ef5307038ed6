"""Give result JSONs written before qkv.bench.provenance existed its four fields (``machine``,
``command``, ``date``, ``commit``), from what each file itself records and from git history only.

Run once (2026-11-28) over benchmarks/results; kept as the record of how each value was found.
Rules, so that nothing is invented:

* ``machine``: an existing ``machine`` object keeps every key and gains the missing standard ones
  (cpu_model, cpu_family, cpu_model_number, avx2, avx512_bf16, amx, threads, gpu), each from another
  key of the same file (``cpu``, ``flags``, ``amx_bf16``, ``torch_threads``, ``cuda_device``, ...) or
  ``"unknown"`` (``avx2`` is true where torch recorded AVX2 or AVX512 kernels, ``cpu_family`` is taken
  from a note that states it; ``backfilled_from`` names such a source). A file without one takes its
  ``environment`` object (qkv bench suites, experiments) or, for a table collected from other
  results, the machine those rows record when they all agree.
  A machine named in the file's name (``epyc_zen5``, ``xeon_amx``, ``h200``, ...) is copied as
  ``machine_named_in_file_name``, a name, never turned into a family or a flag.
* ``command``: the file's own, else ``"unknown"``.
* ``date``: the file's own ``date``; else the clock the machine block recorded (``time``/``date``,
  the machine's local time, zone not recorded); else the date of the commit that added the file,
  in UTC. ``date_source`` says which.
* ``commit``: the file's own, else ``"unknown"`` (the commit a result ran on was never recorded);
  ``committed_in`` is the commit that added the file, which the run is no later than.

    python benchmarks/backfill_provenance.py            # rewrites the files that lack a field
    python benchmarks/backfill_provenance.py --check    # exit 1 if any would change
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
UNKNOWN = "unknown"
STANDARD = ("cpu_model", "cpu_family", "cpu_model_number", "avx2", "avx512_bf16", "amx", "threads", "gpu")
# machines the results' names mention, longest first (a name, copied as it is)
NAMED = (
    "epyc_zen4_avx2",
    "epyc_zen5",
    "epyc_zen4",
    "xeon_amx_slow",
    "xeon_amx",
    "xeon_avx512",
    "xeon",
    "zen5",
    "h200",
    "h100",
)


def moved_from() -> dict[str, str]:
    """New path -> old path, from the moves of the regrouping (/work/moves.tsv or the git rename)."""
    out = subprocess.run(
        [
            "git",
            "-C",
            str(REPO),
            "log",
            "--format=",
            "--name-status",
            "-M",
            "--diff-filter=R",
            "--",
            "benchmarks/results",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    renames = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0].startswith("R"):
            renames.setdefault(parts[2], parts[1])
    return renames


def added_in(path: str, renames: dict[str, str]) -> tuple[str, str] | None:
    """(commit, UTC date) of the commit that added ``path`` (followed through its move), or None."""
    old = renames.get(path, path)
    out = subprocess.run(
        ["git", "-C", str(REPO), "log", "--diff-filter=A", "--format=%H %cI", "--", old],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if len(out) < 2:
        return None
    sha, when = out[-2], out[-1]  # the oldest addition
    return sha, datetime.fromisoformat(when).astimezone(timezone.utc).isoformat(timespec="seconds")


def flag(source: dict, name: str, *aliases: str):
    for key in (name, *aliases):
        if isinstance(source.get(key), bool):
            return source[key]
    flags = source.get("flags")
    if isinstance(flags, dict):
        for key in (name, *aliases):
            if isinstance(flags.get(key), bool):
                return flags[key]
    return UNKNOWN


def standard_fields(source: dict) -> dict:
    """The standard machine keys, each from what ``source`` records or "unknown"."""
    cpu = source.get("cpu_model") or source.get("cpu")
    threads = next(
        (source[k] for k in ("threads", "torch_threads", "threads_per_process") if isinstance(source.get(k), int)),
        UNKNOWN,
    )
    return {
        "cpu_model": cpu if isinstance(cpu, str) and cpu else UNKNOWN,
        "cpu_family": source.get("cpu_family") or UNKNOWN,
        "cpu_model_number": source.get("cpu_model_number") or UNKNOWN,
        "avx2": flag(source, "avx2"),
        "avx512_bf16": flag(source, "avx512_bf16"),
        "amx": flag(source, "amx", "amx_bf16"),
        "threads": threads,
        "gpu": source.get("gpu") or source.get("cuda_device") or UNKNOWN,
    }


def collected_machine(report: dict) -> dict | None:
    """For a table of other results' rows (recipe_sweep --collect): their machine, when all agree."""
    rows = report.get("candidates")
    rows = list(rows.values()) if isinstance(rows, dict) else rows if isinstance(rows, list) else []
    machines = [
        {k: v for k, v in row["machine"].items() if k != "loadavg_end"}
        for row in rows
        if isinstance(row, dict) and isinstance(row.get("machine"), dict)
    ]
    if not machines or len(machines) != len(rows) or any(m != machines[0] for m in machines):
        return None
    return {**machines[0], "machine_source": "the machine every collected row records (candidates[*].machine)"}


def backfill(path: Path, report: dict, renames: dict[str, str]) -> dict:
    rel = path.relative_to(REPO).as_posix()
    out = dict(report)
    named = next((n for n in NAMED if re.search(rf"(^|_){n}(_|\.|$)", path.name)), None)
    machine = out.get("machine")
    if not isinstance(machine, dict):
        if isinstance(out.get("environment"), dict):
            machine = {**out["environment"], "machine_source": "this file's environment object"}
        else:
            machine = collected_machine(out) or {}
        if isinstance(out.get("machine"), str):  # a machine written as words stays, as a note
            machine["note"] = out["machine"]
    machine = dict(machine)
    found = standard_fields(machine)
    derived = {}
    if found["avx2"] == UNKNOWN and machine.get("cpu_capability") in ("AVX2", "AVX512"):
        found["avx2"] = True  # torch dispatches AVX2 or AVX512 kernels only on a CPU that has AVX2
        derived["avx2"] = (
            f"cpu_capability {machine['cpu_capability']}: torch ran its {machine['cpu_capability']} "
            "kernels, which it picks only on a CPU with AVX2 (every AVX512 CPU has it)"
        )
    notes = " ".join(str(out.get(k, "")) for k in ("note", "what", "task")) + " " + str(machine.get("note", ""))
    families = set(re.findall(r"family (\d+)", notes))
    if found["cpu_family"] == UNKNOWN and len(families) == 1:
        found["cpu_family"] = families.pop()
        derived["cpu_family"] = "the file's note"
    for key, value in found.items():
        machine.setdefault(key, value)
    if derived and "backfilled_from" not in machine:
        machine["backfilled_from"] = derived
    if named and "machine_named_in_file_name" not in machine:
        machine["machine_named_in_file_name"] = named
    out["machine"] = machine
    out.setdefault("command", UNKNOWN)
    added = added_in(rel, renames)
    if "date" not in out:
        clock = machine.get("time") or machine.get("date")
        if isinstance(clock, str) and re.match(r"\d{4}-\d\d-\d\d", clock):
            out["date"] = clock.replace(" ", "T")
            out["date_source"] = (
                "machine."
                + ("time" if machine.get("time") else "date")
                + ": the clock of the machine that wrote it, local time, zone not recorded"
            )
        elif added:
            out["date"] = added[1]
            out["date_source"] = "committed: when the commit that added this file was made (the run is no later)"
        else:
            out["date"] = UNKNOWN
    out.setdefault("commit", UNKNOWN)
    if added and "committed_in" not in out:
        out["committed_in"] = added[0]
    return out


def dumps_like(text: str, old: dict, new: dict) -> str:
    """``new`` as JSON in the layout ``text`` (the JSON of ``old``) has: its indent, its ASCII escaping,
    its final newline; keys in their old order, new ones after. The house layout where none matches."""
    for indent in (2, 1, 4):
        for ascii_only in (True, False):
            for end in ("\n", ""):
                if json.dumps(old, indent=indent, ensure_ascii=ascii_only) + end == text:
                    return json.dumps(new, indent=indent, ensure_ascii=ascii_only, allow_nan=False) + end
    return json.dumps(new, indent=2, allow_nan=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    args = parser.parse_args()
    renames = moved_from()
    changed = []
    for path in sorted(RESULTS.rglob("*.json")):
        text = path.read_text()
        report = json.loads(text)
        if not isinstance(report, dict):
            continue
        new = backfill(path, report, renames)
        if new != report:
            changed.append(path)
            if not args.check:
                path.write_text(dumps_like(text, report, new))
    print(f"{len(changed)} file(s) {'would change' if args.check else 'changed'}")
    for path in changed:
        print(" ", path.relative_to(REPO))
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
