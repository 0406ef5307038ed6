"""Load test of ``qkv serve``'s ``POST /v1/translate``: dynamic batching on against one-at-a-time
decoding, and stalled clients beside live ones.

    python benchmarks/serve_load.py --run /work/runs/en-de --overwrite

For each mode (batching on: ``--max-batch-wait`` ms, default 5; off: ``--max-batch-wait 0``) the real
server is started (``python -m qkv serve --port 0``) and 1, 8 and 32 concurrent clients each send one
Multi30k test2016 English sentence per request, on a connection of their own, until the phase's
requests are sent; throughput (requests/s, sentences/s) and p50/p99 latency are measured per phase,
after a warm-up. Then, batching on, 16 stalled clients (TCP connections that send the headers and
half of the body, then nothing) are held open beside 32 live clients: every valid request must be
answered 200 (refused or failed: 0). Writes benchmarks/results/deploy/serve_load.json.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.runtime.machine import environment

CLIENTS = (1, 8, 32)
STALLED = 16
TIMEOUT_S = 600.0  # a request unanswered this long counts as failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="/work/runs/en-de", help="a translation run folder (read only)")
    parser.add_argument("--data", default=None, help="the Multi30k folder (default $QKV_DATA/multi30k)")
    parser.add_argument("--beam", type=int, default=1, help="beam size of every request (default 1, greedy)")
    parser.add_argument("--alpha", type=float, default=0.6, help="length penalty of every request (default 0.6)")
    parser.add_argument("--max-batch-wait", type=float, default=5.0, help="the batching mode's wait, ms (default 5)")
    parser.add_argument("--requests-per-client", type=int, default=8, help="requests each client sends (default 8)")
    parser.add_argument("--min-requests", type=int, default=32, help="requests per phase at least (default 32)")
    parser.add_argument("--contended", action="store_true", help="record that other jobs shared the machine")
    add_result_options(parser, "benchmarks/results/deploy/serve_load.json")
    args = parser.parse_args()
    out = check_result_file(parser, args)
    if args.max_batch_wait <= 0:
        parser.error("--max-batch-wait must be positive (the one-at-a-time mode is measured anyway)")
    data, sentences = read_sentences(args.data)
    report: dict = {
        "what": "qkv serve POST /v1/translate under load: dynamic batching on vs one-at-a-time decoding, "
        "and 16 stalled clients beside 32 live ones",
        "run": str(Path(args.run).resolve()),
        "data": f"Multi30k test2016 ({data}), {len(sentences)} sentences, one per request",
        "beam_size": args.beam,
        "alpha": args.alpha,
        "clients": list(CLIENTS),
        "requests_per_phase": {str(c): phase_requests(args, c) for c in CLIENTS},
        "contended": args.contended,
        "machine": environment(),
        "phases": [],
    }
    for wait in (args.max_batch_wait, 0.0):
        with Server(args.run, wait) as server:
            for clients in CLIENTS:
                phase = measure(server, sentences, clients, phase_requests(args, clients), args)
                phase["batching"] = "on" if wait else "off"
                phase["max_batch_wait_ms"] = wait
                report["phases"].append(phase)
                print(json.dumps(phase), flush=True)
            if wait:
                report["stalled"] = stalled_phase(server, sentences, args)
                print(json.dumps(report["stalled"]), flush=True)
    report["speedup_at_32_clients"] = speedup(report["phases"], 32)
    write_result(out, report)
    print(f"wrote {out}")
    failed = report["stalled"]["refused_or_failed_valid_requests"] + sum(p["failed"] for p in report["phases"])
    if failed:
        print(f"serve_load.py: {failed} valid requests were refused or failed", file=sys.stderr)
    return 1 if failed else 0


def phase_requests(args: argparse.Namespace, clients: int) -> int:
    return max(args.min_requests, args.requests_per_client * clients)


def read_sentences(data: str | None) -> tuple[str, list[str]]:
    folder = Path(data) if data else Path(os.environ.get("QKV_DATA", "data")) / "multi30k"
    path = folder / "test_2016_flickr.en.gz"
    if not path.is_file():
        sys.exit(f"serve_load.py: error: {path} not found (set QKV_DATA or pass --data)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return str(path), [line.strip() for line in f if line.strip()]


class Server:
    """``python -m qkv serve --model RUN --port 0 --max-batch-wait W`` as a child process."""

    def __init__(self, run: str, wait_ms: float) -> None:
        self.command = [sys.executable, "-m", "qkv", "serve", "--model", run, "--port", "0"]
        self.command += ["--max-batch-wait", str(wait_ms), "--max-texts", "64"]

    def __enter__(self) -> Server:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " on http://" not in line:
            self.proc.kill()
            sys.exit(f"serve_load.py: error: the server did not start: {line!r}")
        host_port = line.split(" on http://", 1)[1].split("/", 1)[0]
        host, port = host_port.rsplit(":", 1)
        self.address = (host, int(port))
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def batches(self) -> int:
        conn = http.client.HTTPConnection(*self.address, timeout=60)
        try:
            conn.request("GET", "/health")
            return sum(json.loads(conn.getresponse().read())["translation_batches"].values())
        finally:
            conn.close()


def client_loop(
    address: tuple[str, int], jobs: list[str], lock: threading.Lock, args: argparse.Namespace, log: list
) -> None:
    """Take sentences from ``jobs`` until it is empty; one request each on a keep-alive connection."""
    conn = http.client.HTTPConnection(*address, timeout=TIMEOUT_S)
    while True:
        with lock:
            if not jobs:
                break
            sentence = jobs.pop()
        body = json.dumps({"texts": [sentence], "beam_size": args.beam, "alpha": args.alpha})
        start = time.perf_counter()
        try:
            conn.request("POST", "/v1/translate", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
            ok = response.status == 200 and len(json.loads(payload)["translations"]) == 1
            status: int | str = response.status
        except (OSError, http.client.HTTPException, ValueError) as err:
            ok, status = False, type(err).__name__
            conn.close()
            conn = http.client.HTTPConnection(*address, timeout=TIMEOUT_S)
        log.append((ok, status, time.perf_counter() - start))
    conn.close()


def run_clients(
    address: tuple[str, int], sentences: list[str], clients: int, n: int, args: argparse.Namespace
) -> tuple[list, float]:
    jobs = [sentences[i % len(sentences)] for i in range(n)][::-1]
    lock, log = threading.Lock(), []
    threads = [threading.Thread(target=client_loop, args=(address, jobs, lock, args, log)) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return log, time.perf_counter() - start


def summary(log: list, wall: float) -> dict:
    latencies = sorted(seconds for ok, _, seconds in log if ok)
    answered = len(latencies)
    return {
        "requests": len(log),
        "ok": answered,
        "failed": len(log) - answered,
        "failures": sorted({str(status) for ok, status, _ in log if not ok}),
        "wall_s": round(wall, 3),
        "requests_per_s": round(answered / wall, 3),
        "sentences_per_s": round(answered / wall, 3),  # one sentence per request
        "latency_s": {
            "p50": round(percentile(latencies, 50), 4),
            "p99": round(percentile(latencies, 99), 4),
            "mean": round(statistics.fmean(latencies), 4) if latencies else None,
        },
    }


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile of sorted ``values``."""
    if not values:
        return float("nan")
    rank = max(1, min(len(values), -(-len(values) * q // 100)))
    return values[int(rank) - 1]


def measure(server: Server, sentences: list[str], clients: int, n: int, args: argparse.Namespace) -> dict:
    run_clients(server.address, sentences[-64:], clients, clients, args)  # warm-up, sentences not measured
    before = server.batches()
    log, wall = run_clients(server.address, sentences, clients, n, args)
    batches = server.batches() - before
    return {
        "clients": clients,
        **summary(log, wall),
        "batches": batches,
        "mean_batch_requests": round(sum(ok for ok, _, _ in log) / max(1, batches), 2),
    }


def stall(address: tuple[str, int]) -> socket.socket:
    """A client that sends the headers and half of its body, then nothing."""
    body = json.dumps({"texts": ["A man rides a bicycle down the street."]}).encode()
    sock = socket.create_connection(address, timeout=TIMEOUT_S)
    sock.sendall(
        b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body[: len(body) // 2])
    )
    return sock


def stalled_phase(server: Server, sentences: list[str], args: argparse.Namespace) -> dict:
    stalled = [stall(server.address) for _ in range(STALLED)]
    n = phase_requests(args, 32)
    log, wall = run_clients(server.address, sentences, 32, n, args)
    still_open = 0
    for sock in stalled:  # the stalled connections were neither answered nor dropped: the server waits on them
        sock.setblocking(False)
        try:
            sock.recv(1)  # b"": the server closed it; bytes: it answered
        except BlockingIOError:  # nothing to read: still open, still waiting for the rest of the body
            still_open += 1
        except OSError:
            pass
        sock.close()
    return {
        "stalled_clients": STALLED,
        "live_clients": 32,
        "stalled_still_open_at_end": still_open,
        **summary(log, wall),
        "refused_or_failed_valid_requests": len(log) - sum(1 for ok, _, _ in log if ok),
    }


def speedup(phases: list[dict], clients: int) -> float | None:
    found = {p["batching"]: p["requests_per_s"] for p in phases if p["clients"] == clients}
    if found.get("off"):
        return round(found["on"] / found["off"], 2)
    return None


if __name__ == "__main__":
    sys.exit(main())
