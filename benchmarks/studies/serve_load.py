"""Load test for ``qkv serve``: valid requests from many clients while slow clients hold connections.

    python benchmarks/studies/serve_load.py                       # 2,000 requests, 32 clients, 16 stalled connections
    python benchmarks/studies/serve_load.py --requests 200        # a quick look
    python benchmarks/studies/serve_load.py --model path/to/bert  # another model (default: all-MiniLM-L6-v2)

The server runs as a subprocess (``qkv serve --port 0``) on 127.0.0.1, so its memory
is its own and the clients do not share its interpreter. Meanwhile:

* ``--clients`` threads send ``--requests`` valid ``POST /api/attend`` requests between them, one
  connection each (the server speaks HTTP/1.0). A 503 is retried after its ``Retry-After`` and
  counted; so is a connection error. Latency is from the first attempt to the 200 (retries and
  their waits included), and separately for the attempt that got the 200.
* ``--stalled`` threads each hold a connection that sent its headers (``Content-Length: 200``) and
  20 bytes of body, and then wait; when the server closes it (408 after ``--timeout``), they open
  another, until the valid requests are done.

Writes ``benchmarks/results/reliability/serve_load.json`` (the figures, the server's memory before and after,
the machine) and exits 1 if a valid request went unanswered or the server answered 5xx other than
503. Bounded: the clients stop after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file

SENTENCES = [
    "time flies like an arrow",
    "the cat sat on the mat",
    "the animal did not cross the street because it was too tired",
    "a dog runs on the beach",
    "attention is all you need",
    "she gave the book to her brother because he asked for it",
    "fruit flies like a banana",
    "the quick brown fox jumps over the lazy dog",
]
MAX_ATTEMPTS = 60  # per valid request; a request still refused after these counts as unanswered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a BERT checkpoint folder (default: all-MiniLM-L6-v2, the serve default)")
    parser.add_argument("--requests", type=int, default=2000, help="valid requests to send (default 2000)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--stalled", type=int, default=16, help="stalled connections held open (default 16)")
    parser.add_argument("--timeout", type=float, default=10.0, help="the server's --timeout (default 10)")
    parser.add_argument("--max-concurrent", type=int, default=32, help="the server's --max-concurrent (default 32)")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="stop the clients after this long (300)")
    add_result_options(parser, Path(__file__).resolve().parents[1] / "results" / "reliability" / "serve_load.json")
    args = parser.parse_args(argv)
    check_result_file(parser, args)  # before any work
    for name in ("requests", "clients", "max_concurrent"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.stalled < 0 or not args.timeout > 0 or not args.max_seconds > 0:
        parser.error("--stalled must be >= 0, --timeout and --max-seconds > 0")

    machine = describe_machine()
    command = [
        sys.executable,
        "-c",
        "import sys; from qkv.cli import main; sys.exit(main())",
        "serve",
        "--port",
        "0",
        "--timeout",
        f"{args.timeout:g}",
        "--max-concurrent",
        str(args.max_concurrent),
    ]
    command += ["--model", args.model] if args.model else []
    with tempfile.TemporaryFile("w+") as server_log:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=server_log, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
        )
        try:
            address = wait_for_address(proc, deadline_s=180)
            rss_before = memory(proc.pid)
            cpu_before = cpu_seconds(proc.pid)
            load = run_load(address, args)
            rss_after = memory(proc.pid)
            cpu_after = cpu_seconds(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server_log.seek(0)
        log = server_log.read()

    answered = load.pop("answered_200")
    server_5xx = load["other_statuses"].get("5xx", 0)
    result = {
        "benchmark": "qkv serve under load with stalled connections (benchmarks/serve_load.py)",
        "command": " ".join(["python benchmarks/studies/serve_load.py", *(argv if argv is not None else sys.argv[1:])]),
        "server_command": " ".join(["qkv"] + command[3:]),
        "model": args.model or "all-MiniLM-L6-v2 (the qkv serve default)",
        "settings": {
            "requests": args.requests,
            "clients": args.clients,
            "stalled_connections": args.stalled,
            "server_timeout_s": args.timeout,
            "server_max_concurrent": args.max_concurrent,
            "retry_after_honoured": True,
            "max_attempts_per_request": MAX_ATTEMPTS,
        },
        "valid_requests_answered_200": answered,
        "valid_requests_unanswered": args.requests - answered,
        "server_errors_5xx_except_503": server_5xx,
        **load,
        "server_cpu_s": round(cpu_after - cpu_before, 2),
        "server_rss_mib": {"before": rss_before["VmRSS"], "after": rss_after["VmRSS"], "peak": rss_after["VmHWM"]},
        "server_log_tracebacks": log.count("Traceback"),
        "machine": machine,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    result["ok"] = (
        answered == args.requests
        and server_5xx == 0
        and result["server_log_tracebacks"] == 0
        and load["stalled"]["longest_held_s"] is not None
        and load["stalled"]["longest_held_s"] < args.timeout + 5
    )
    write_result(args.out, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "valid_requests_answered_200",
                    "server_errors_5xx_except_503",
                    "busy_503",
                    "latency_ms",
                    "requests_per_s",
                    "server_rss_mib",
                    "ok",
                )
            }
        )
    )
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


def run_load(address: tuple[str, int], args) -> dict:
    stop = threading.Event()
    deadline = time.monotonic() + args.max_seconds
    lock = threading.Lock()
    next_index = iter(range(args.requests))
    latencies, attempt_latencies = [], []
    counts = {"answered_200": 0, "busy_503": 0, "requests_retried_after_503": 0, "connection_errors": 0}
    attempts_histogram: dict[int, int] = {}  # attempts a request took to get its 200 -> how many requests
    error_kinds: dict[str, int] = {}
    other_statuses: dict[str, int] = {}
    stalled = {"connections": 0, "closed_with_408": 0, "closed_with_503": 0, "closed_silently": 0, "held_s": []}

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            body = json.dumps({"text": SENTENCES[i % len(SENTENCES)]}).encode()
            start = time.perf_counter()
            retried = False
            for attempts in range(1, MAX_ATTEMPTS + 1):
                if time.monotonic() >= deadline:
                    return
                attempt = time.perf_counter()
                try:
                    status, retry_after = post(address, body)
                except OSError as err:
                    with lock:
                        counts["connection_errors"] += 1
                        error_kinds[type(err).__name__] = error_kinds.get(type(err).__name__, 0) + 1
                    time.sleep(0.1)
                    continue
                now = time.perf_counter()
                if status == 200:
                    with lock:
                        counts["answered_200"] += 1
                        counts["requests_retried_after_503"] += retried
                        attempts_histogram[attempts] = attempts_histogram.get(attempts, 0) + 1
                        latencies.append(now - start)
                        attempt_latencies.append(now - attempt)
                    break
                with lock:
                    key = "busy_503" if status == 503 else f"{status // 100}xx" if status >= 500 else str(status)
                    if status == 503:
                        counts["busy_503"] += 1
                    else:
                        other_statuses[key] = other_statuses.get(key, 0) + 1
                if status != 503:
                    break  # a valid request refused otherwise is a failure, not something to retry
                retried = True
                time.sleep(retry_after)

    def staller() -> None:
        while not stop.is_set():
            try:
                sock = socket.create_connection(address, timeout=args.timeout + 30)
                sock.sendall(
                    b"POST /api/attend HTTP/1.0\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 200\r\n\r\n" + b'{"text": "' + b"a" * 10
                )
                sent = time.perf_counter()
                reply = b""
                while chunk := sock.recv(4096):
                    reply += chunk
                held = time.perf_counter() - sent
                sock.close()
            except OSError:
                continue
            status = reply[9:12]
            with lock:
                stalled["connections"] += 1
                kind = {b"408": "closed_with_408", b"503": "closed_with_503"}.get(status, "closed_silently")
                stalled[kind] += 1
                if status == b"408":
                    stalled["held_s"].append(held)
            if status == b"503":
                time.sleep(0.2)

    stallers = [threading.Thread(target=staller, daemon=True) for _ in range(args.stalled)]
    for thread in stallers:
        thread.start()
    time.sleep(0.5)  # let the stalled connections take their slots first
    clients = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    start = time.perf_counter()
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    elapsed = time.perf_counter() - start
    stop.set()
    for thread in stallers:  # each finishes when the server next closes its connection
        thread.join(timeout=args.timeout + 35)

    held = stalled.pop("held_s")
    stalled["longest_held_s"] = round(max(held), 2) if held else None
    return {
        "answered_200": counts["answered_200"],
        "busy_503": counts["busy_503"],
        "requests_retried_after_503": counts["requests_retried_after_503"],
        "attempts_per_answered_request": {str(k): v for k, v in sorted(attempts_histogram.items())},
        "connection_errors_retried": counts["connection_errors"],
        "connection_error_kinds": error_kinds,
        "other_statuses": other_statuses,
        "latency_ms": {
            "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99),
            "max": round(1000 * max(latencies), 1) if latencies else None,
            "note": "first attempt to 200, including 503 retries and their Retry-After waits",
        },
        "latency_of_the_200_attempt_ms": {
            "p50": percentile(attempt_latencies, 50),
            "p99": percentile(attempt_latencies, 99),
        },
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(counts["answered_200"] / elapsed, 2),
        "stalled": stalled,
    }


def post(address, body: bytes) -> tuple[int, float]:
    conn = http.client.HTTPConnection(*address, timeout=120)
    try:
        conn.request("POST", "/api/attend", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        reply = response.read()
        if response.status == 200:
            assert json.loads(reply)["example"], reply[:100]
        retry_after = float(response.getheader("Retry-After") or 1)
        return response.status, retry_after
    finally:
        conn.close()


def percentile(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return round(1000 * values[0], 1) if values else None
    return round(1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)


def wait_for_address(proc: subprocess.Popen, *, deadline_s: float) -> tuple[str, int]:
    """The server prints ``serving the attention explorer on http://HOST:PORT/`` once it listens."""
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(deadline_s)
    match = re.search(r"http://([\d.]+):(\d+)/", found[0]) if found else None
    if match is None:
        raise RuntimeError(f"the server did not start within {deadline_s:g} s (exit code {proc.poll()})")
    return match[1], int(match[2])


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak) of ``pid``, in MiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = round(int(value.split()[0]) / 1024, 1)
    return fields


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (fields 14 and 15 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def describe_machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
        platform.processor() or "unknown",
    )
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        lscpu = ""
    flags_line = next((line for line in lscpu.splitlines() if line.startswith("Flags:")), "")
    flags = set(flags_line.split(":", 1)[1].split()) if flags_line else set()
    if not flags:  # lscpu missing: the same flags from /proc/cpuinfo
        flags = set(
            next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
        )
    import torch

    return {
        "cpu": model,
        "threads_available": len(os.sched_getaffinity(0)),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": sorted(flag for flag in flags if flag.startswith("amx")),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "os": platform.platform(),
    }


if __name__ == "__main__":
    sys.exit(main())
