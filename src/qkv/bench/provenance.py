"""What every benchmark result says about where it came from: ``machine``, ``command``, ``date`` and
``commit``, one function for all of ``benchmarks/`` and ``qkv bench``.

* ``machine``: the CPU's model name, family and model number (``"AMD EPYC"`` alone names CPUs from
  AVX2-only ones to AVX512-BF16 ones; family and model tell them apart), the flags that decide how
  fast qkv's CPU paths run (``avx2``, ``avx512_bf16``, ``amx``), the threads torch uses, and the
  GPU's name where CUDA is available;
* ``command``: the command line that ran the benchmark;
* ``date``: when the result was written, UTC, ISO 8601;
* ``commit``: the checkout's git HEAD, with ``-dirty`` when tracked files differ from it, or
  ``"unknown"`` outside a git checkout.

A script builds its report as it likes and writes it with :func:`write_result`, which adds these
fields (a ``machine`` the report already has keeps its own keys and gains the missing ones).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from qkv.runtime.fileio import write_json
from qkv.runtime.machine import cpu_flags, cpuinfo_fields

UNKNOWN = "unknown"
# the flags that decide speed: AVX2 (every kernel's baseline), AVX512-BF16 and AMX (fast bf16 products)
SPEED_FLAGS = {"avx2": "avx2", "avx512_bf16": "avx512_bf16", "amx": "amx_bf16"}
FIELDS = ("machine", "command", "date", "commit")


def machine() -> dict:
    """This machine as a result records it: CPU model name, family, model number, the speed flags,
    torch's threads and, where CUDA is available, the GPU's name (``gpu``; None without one)."""
    import torch

    cpu = cpuinfo_fields("model name", "cpu family", "model", "flags")
    flags = cpu_flags(cpu["flags"] or "")
    info = {
        "cpu_model": cpu["model name"] or UNKNOWN,
        "cpu_family": cpu["cpu family"] or UNKNOWN,
        "cpu_model_number": cpu["model"] or UNKNOWN,
        **{name: flag in flags for name, flag in SPEED_FLAGS.items()},
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if cpu["flags"] is None:  # no /proc/cpuinfo (not Linux): the flags were not read, not absent
        info.update(dict.fromkeys(SPEED_FLAGS, UNKNOWN))
    return info


def command(argv: list[str] | None = None) -> str:
    """The command line that ran this process (``python script.py ARGS``), quoted as a shell would need."""
    argv = sys.argv if argv is None else argv
    return shlex.join(["python", *argv])


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second (``2026-11-28T14:03:00+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_commit(where: str | Path | None = None) -> str:
    """The git HEAD of the checkout holding ``where`` (default: this package's source), ``<sha>-dirty``
    when tracked files differ from it, or ``"unknown"`` outside a git checkout (an installed wheel)."""
    where = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0 or not head.stdout.strip():
            return UNKNOWN
        status = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    sha = head.stdout.strip()
    return f"{sha}-dirty" if status.returncode != 0 or status.stdout.strip() else sha


def provenance(argv: list[str] | None = None) -> dict:
    """``machine``, ``command``, ``date`` and ``commit`` of a result written now by this process."""
    return {"machine": machine(), "command": command(argv), "date": utc_now(), "commit": git_commit()}


def stamp(report: dict, argv: list[str] | None = None) -> dict:
    """``report`` with the four provenance fields added. What the report already says is kept: its own
    ``command``, and the keys of its own ``machine`` (a script's fuller environment, its thread count);
    ``date`` and ``commit`` are always now's."""
    found = provenance(argv)
    own = report.get("machine")
    merged = {**found["machine"], **own} if isinstance(own, dict) else found["machine"]
    if own is not None and not isinstance(own, dict):
        merged["note"] = own
    return {
        **report,
        "machine": merged,
        "command": report.get("command") or found["command"],
        "date": found["date"],
        "commit": found["commit"],
    }


def write_result(path: str | Path, report: dict, argv: list[str] | None = None) -> Path:
    """Write ``report`` as the result JSON ``path``, stamped with :func:`stamp`. Returns ``path``."""
    return write_json(path, stamp(report, argv))


def missing_fields(report: object) -> list[str]:
    """Which of ``machine``, ``command``, ``date``, ``commit`` a result lacks (all, for a non-object)."""
    if not isinstance(report, dict):
        return list(FIELDS)
    return [name for name in FIELDS if report.get(name) in (None, "", {})]
