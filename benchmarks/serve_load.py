"""Load tests of ``qkv serve``: ``POST /v1/translate`` (dynamic batching against one-at-a-time
decoding, stalled clients beside live ones) and ``POST /v1/generate`` (continuous batching against
one request at a time, and 2 server workers beside 1).

    python benchmarks/serve_load.py --run /work/runs/en-de --overwrite
    python benchmarks/serve_load.py --endpoint generate --model /work/runs/shakespeare \\
        --make-gpt2 /work/runs/gpt2-124m-random --overwrite

Translation (``--endpoint translate``, the default): for each mode (batching on: ``--max-batch-wait``
ms, default 5; off: ``--max-batch-wait 0``) the real server is started (``python -m qkv serve --port
0``) and 1, 8 and 32 concurrent clients each send one Multi30k test2016 English sentence per request,
on a connection of their own, until the phase's requests are sent; throughput (requests/s,
sentences/s) and p50/p99 latency are measured per phase, after a warm-up. Then, batching on, 16
stalled clients (TCP connections that send the headers and half of the body, then nothing) are held
open beside 32 live clients: every valid request must be answered 200 (refused or failed: 0). Writes
benchmarks/results/deploy/serve_load.json.

Generation (``--endpoint generate``): for each ``--model`` (a qkv language-model run, a GPT-2
folder; ``--make-gpt2 DIR`` first writes a GPT-2 folder of random weights, 124M's shape unless
``--gpt2-layers``/``--gpt2-width``/``--gpt2-vocab`` shrink it, with a byte-level BPE trained on tiny
Shakespeare, and measures it too) the server is started in each mode: continuous batching (the
default server), one request at a time (``--max-generate-batch 1``) and, continuous, at each other
count of ``--workers`` (default 1,2: the server's ``--workers 2``). A flag the server refuses skips
its mode, with the reason in the report. In each mode 1, 8, 16 and 32 concurrent clients
(``--clients``), each on its own connection, send streamed requests (``{"prompt": a line of tiny
Shakespeare ($QKV_DATA/tinyshakespeare; else a fixed list), "max_tokens": 200, "temperature": 0.8,
"seed": i, "stream": true}``), after a warm-up of short ones. Per phase: tokens/s (every client's
tokens, the ``event: done`` data's ``tokens``, over the phase's wall time), time to first token
(request sent -> first text event) and time per output token ((done event - first text event) /
(tokens - 1)), p50 and p99, and failed requests; per model, continuous over one-at-a-time tokens/s
at each client count (the target: >= 4x at 16 clients on 2 cores). Writes
benchmarks/results/deploy/serve_generate_load.json. Exit status 1 when a request failed.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.runtime.machine import environment

CLIENTS = (1, 8, 32)
GENERATE_CLIENTS = "1,8,16,32"
OUTPUTS = {
    "translate": "benchmarks/results/deploy/serve_load.json",
    "generate": "benchmarks/results/deploy/serve_generate_load.json",
}
STALLED = 16
TIMEOUT_S = 600.0  # a request unanswered this long counts as failed
# prompts when tiny Shakespeare is not found: letters every character-level Shakespeare model knows
PROMPTS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n",
    "MENENIUS:\nWhat work's, my countrymen, in hand? where go you\n",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
    "HAMLET:\nTo be, or not to be, that is the question:\n",
    "GLOUCESTER:\nNow is the winter of our discontent\n",
)


def main() -> int:
    """Parse the options and run the translation or the generation load test."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", choices=("translate", "generate"), default="translate", help="what to load")
    parser.add_argument("--run", default="/work/runs/en-de", help="translate: a translation run folder (read only)")
    parser.add_argument("--data", default=None, help="translate: the Multi30k folder (default $QKV_DATA/multi30k)")
    parser.add_argument("--beam", type=int, default=1, help="translate: beam size of every request (default 1)")
    parser.add_argument("--alpha", type=float, default=0.6, help="translate: length penalty (default 0.6)")
    parser.add_argument("--max-batch-wait", type=float, default=5.0, help="translate: batching's wait, ms (default 5)")
    parser.add_argument("--model", action="append", default=[], help="generate: a language model to serve (repeat)")
    parser.add_argument("--make-gpt2", metavar="DIR", help="generate: write a random GPT-2 folder to DIR, measure it")
    parser.add_argument("--gpt2-layers", type=int, default=12, help="--make-gpt2's layers (default 12)")
    parser.add_argument("--gpt2-width", type=int, default=768, help="--make-gpt2's width (default 768)")
    parser.add_argument("--gpt2-vocab", type=int, default=50257, help="--make-gpt2's vocabulary (default 50257)")
    parser.add_argument("--max-tokens", type=int, default=200, help="generate: tokens per request (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="generate: sampling temperature (default 0.8)")
    parser.add_argument("--workers", default="1,2", help="generate: server worker counts, continuous (default 1,2)")
    parser.add_argument(
        "--clients", help=f"concurrent clients per phase (default {GENERATE_CLIENTS}; translate 1,8,32)"
    )
    parser.add_argument("--requests-per-client", type=int, help="requests each client sends (default 8; generate 2)")
    parser.add_argument("--min-requests", type=int, help="requests per phase at least (default 32; generate 8)")
    parser.add_argument("--contended", action="store_true", help="record that other jobs shared the machine")
    add_result_options(parser, None, what=f"the result JSON (default {OUTPUTS['translate']}, or {OUTPUTS['generate']})")
    args = parser.parse_args()
    generate = args.endpoint == "generate"
    args.out = args.out or OUTPUTS[args.endpoint]
    args.requests_per_client = args.requests_per_client or (2 if generate else 8)
    args.min_requests = args.min_requests or (8 if generate else 32)
    args.clients = counts(parser, "--clients", args.clients or (GENERATE_CLIENTS if generate else "1,8,32"))
    args.workers = counts(parser, "--workers", args.workers)
    out = check_result_file(parser, args)
    for flag in ("requests_per_client", "min_requests", "max_tokens", "gpt2_layers", "gpt2_width", "gpt2_vocab"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if not generate:
        if args.max_batch_wait <= 0:
            parser.error("--max-batch-wait must be positive (the one-at-a-time mode is measured anyway)")
        return translate_main(args, out)
    if not args.model and not args.make_gpt2:
        parser.error("--endpoint generate needs --model PATH or --make-gpt2 DIR")
    if args.gpt2_width % gpt2_heads(args.gpt2_width):
        parser.error(f"--gpt2-width {args.gpt2_width} is not a multiple of its {gpt2_heads(args.gpt2_width)} heads")
    return generate_main(args, out)


def counts(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """``"1,8,32"`` as ``[1, 8, 32]``; the parser's error for anything but positive integers."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        parser.error(f"{flag} must be positive integers separated by commas, got {text!r}")
    return values


def translate_main(args: argparse.Namespace, out: Path) -> int:
    """The translation load test (see the module's docstring)."""
    data, sentences = read_sentences(args.data)
    report: dict = {
        "what": "qkv serve POST /v1/translate under load: dynamic batching on vs one-at-a-time decoding, "
        "and 16 stalled clients beside 32 live ones",
        "run": str(Path(args.run).resolve()),
        "data": f"Multi30k test2016 ({data}), {len(sentences)} sentences, one per request",
        "beam_size": args.beam,
        "alpha": args.alpha,
        "clients": args.clients,
        "requests_per_phase": {str(c): phase_requests(args, c) for c in args.clients},
        "contended": args.contended,
        "machine": environment(),
        "phases": [],
    }
    for wait in (args.max_batch_wait, 0.0):
        with Server(args.run, ["--max-batch-wait", str(wait), "--max-texts", "64"]) as server:
            for clients in args.clients:
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


class FlagRefused(Exception):
    """The server refused a command-line flag (a ``qkv serve`` without that option yet)."""


class Server:
    """``python -m qkv serve --model MODEL --port 0 FLAGS...`` as a child process; ``address`` is where
    it listens, read from its first line (``serving on http://HOST:PORT/ ...``)."""

    def __init__(self, model: str, flags: list[str]) -> None:
        self.command = [sys.executable, "-m", "qkv", "serve", "--model", model, "--port", "0", *flags]

    def __enter__(self) -> Server:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if " on http://" in line:
                break
        else:
            self.proc.wait()
            self.stderr.seek(0)
            told = [line.strip() for line in self.stderr.read().splitlines() if line.strip()]
            self.stderr.close()
            last = told[-1] if told else f"exit status {self.proc.returncode}"
            if "unrecognized arguments" in last:
                raise FlagRefused(last)
            sys.exit(f"serve_load.py: error: the server did not start ({shlex.join(self.command)}): {last}")
        # the rest of its output is read and dropped, so a full pipe never blocks the server
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        host_port = line.split(" on http://", 1)[1].split("/", 1)[0]
        host, port = host_port.rsplit(":", 1)
        self.address = (host.strip("[]"), int(port))
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.stderr.close()

    def batches(self) -> int:
        """Translation batches decoded so far (``GET /health``)."""
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
    log: list = []
    return log, timed_clients(client_loop, (address, jobs, threading.Lock(), args, log), clients)


def timed_clients(loop: Callable[..., None], work: tuple, clients: int) -> float:
    """Run ``loop(*work)`` on ``clients`` threads at once; the seconds until the last one ends."""
    threads = [threading.Thread(target=loop, args=work) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


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


def generate_main(args: argparse.Namespace, out: Path) -> int:
    """The generation load test (see the module's docstring)."""
    prompts, source = read_prompts()
    models = [str(Path(model).resolve()) for model in args.model]
    if args.make_gpt2:
        models.append(str(make_gpt2(args.make_gpt2, args.gpt2_layers, args.gpt2_width, args.gpt2_vocab).resolve()))
    modes = [("continuous", 1, []), ("one_at_a_time", 1, ["--max-generate-batch", "1"])]
    modes += [("continuous", n, ["--workers", str(n)]) for n in args.workers if n != 1]
    queue = ["--max-queue", str(2 * max(args.clients) + 8), "--max-new-tokens", str(max(512, args.max_tokens))]
    report: dict = {
        "what": "qkv serve POST /v1/generate under load, streamed: continuous batching vs one request at a "
        "time (--max-generate-batch 1), and continuous at more server workers",
        "prompts": source,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "clients": args.clients,
        "workers": args.workers,
        "requests_per_phase": {str(c): phase_requests(args, c) for c in args.clients},
        "target": "continuous / one-at-a-time tokens/s >= 4 at 16 clients on 2 cores",
        "contended": args.contended,
        "machine": environment(),
        "models": [],
    }
    failed = 0
    for model in models:
        entry: dict = {"model": model, "config": model_config(model), "phases": [], "skipped": []}
        for mode, workers, flags in modes:
            try:
                with Server(model, [*queue, *flags]) as server:
                    for clients in args.clients:
                        phase = {"mode": mode, "workers": workers, **generation_phase(server, prompts, clients, args)}
                        entry["phases"].append(phase)
                        failed += phase["failed"]
                        print(json.dumps({"model": Path(model).name, **phase}), flush=True)
            except FlagRefused as err:
                entry["skipped"].append(f"{mode}, {workers} worker(s): the server refused {shlex.join(flags)}: {err}")
                print(f"serve_load.py: skipped {entry['skipped'][-1]}", file=sys.stderr, flush=True)
        entry["ratio_continuous_over_one_at_a_time"] = ratios(entry["phases"], args.clients)
        report["models"].append(entry)
    write_result(out, report)
    print(f"wrote {out}")
    if failed:
        print(f"serve_load.py: {failed} generate requests failed", file=sys.stderr)
    return 1 if failed else 0


def read_prompts() -> tuple[list[str], str]:
    """Lines of tiny Shakespeare ($QKV_DATA/tinyshakespeare/input.txt, at least 20 characters, not a
    speaker's name), or the fixed :data:`PROMPTS` where it is not found; and where they came from."""
    from qkv.data.text import resolve_tinyshakespeare

    try:
        path = resolve_tinyshakespeare(download=False)
    except FileNotFoundError:
        return list(PROMPTS), f"{len(PROMPTS)} fixed prompts (tiny Shakespeare not found)"
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if len(line) >= 20 and not line.endswith(":")][:512]
    if not lines:
        sys.exit(f"serve_load.py: error: {path} has no line of 20 characters or more to prompt with")
    return lines, f"tiny Shakespeare ({path}), its first {len(lines)} lines of 20 characters or more"


def gpt2_heads(width: int) -> int:
    """GPT-2's heads for a width: one per 64 dimensions (12 at 768), at least one."""
    return max(1, width // 64)


def make_gpt2(folder: str | Path, layers: int, width: int, vocab: int) -> Path:
    """Write a GPT-2 folder of random weights (transformers' ``GPT2LMHeadModel.save_pretrained``) with
    a byte-level BPE trained on tiny Shakespeare as ``tokenizer.json``, ``<|endoftext|>`` its id 0;
    where the BPE stops short of ``vocab``, tokens ``<|unusedN|>`` fill the rest, so every id the model
    can sample decodes. A folder that already holds ``config.json`` is used as it is."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        print(f"using the GPT-2 folder {folder} as it is", flush=True)
        return folder
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        sys.exit(f"serve_load.py: error: --make-gpt2 {folder}: exists and holds no config.json")
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from qkv.data.text import resolve_tinyshakespeare

    try:
        text = resolve_tinyshakespeare(download=False)
    except FileNotFoundError as err:
        sys.exit(f"serve_load.py: error: --make-gpt2: {err}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train([str(text)], trainer)
    bpe.add_tokens([f"<|unused{i}|>" for i in range(bpe.get_vocab_size(), vocab)])
    if bpe.get_vocab_size() != vocab:
        sys.exit(f"serve_load.py: error: --gpt2-vocab {vocab} is below the BPE's byte alphabet (257 tokens)")
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=1024,
        n_embd=width,
        n_layer=layers,
        n_head=gpt2_heads(width),
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(partial))
    bpe.save(str(partial / "tokenizer.json"))
    os.replace(partial, folder)
    print(f"wrote {folder}: GPT-2, {layers} layers, width {width}, vocabulary {vocab}, random weights", flush=True)
    return folder


def model_config(folder: str) -> dict:
    """A model's shape as its ``config.json`` says: a GPT-2 folder's (random weights when made here) or
    a qkv run's ``model`` section."""
    data = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    if data.get("model_type") == "gpt2":
        return {"kind": "gpt2", **{k: data.get(k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")}}
    return {"kind": data.get("task", "unknown"), **data.get("model", {})}


def generate_loop(
    address: tuple[str, int], jobs: list, lock: threading.Lock, max_tokens: int, temperature: float, log: list
) -> None:
    """Take ``(seed, prompt)`` from ``jobs`` until it is empty; one streamed request each on a keep-alive
    connection, timed: ``log`` gets ``(ok, status, tokens, time to first token, time per output token)``."""
    conn = http.client.HTTPConnection(*address, timeout=TIMEOUT_S)
    while True:
        with lock:
            if not jobs:
                break
            seed, prompt = jobs.pop()
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stream": True}
        start = time.perf_counter()
        first = last = tokens = None
        status: int | str = "no done event"
        try:
            conn.request("POST", "/v1/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            name = b""
            for line in iter(response.readline, b""):  # server-sent events, one field a line
                line = line.rstrip(b"\r\n")
                if line.startswith(b"event:"):
                    name = line[6:].strip()
                elif line.startswith(b"data:") and not name and first is None:
                    first = time.perf_counter()
                elif line.startswith(b"data:") and name == b"done":
                    last, tokens = time.perf_counter(), json.loads(line[5:])["tokens"]
                elif line.startswith(b"data:") and name == b"error":
                    status = "error event"
                elif not line:
                    name = b""
            if response.status != 200 or tokens is not None:  # else: an error event, or no done event
                status = response.status
        except (OSError, http.client.HTTPException, ValueError, KeyError) as err:
            status = type(err).__name__
            conn.close()
            conn = http.client.HTTPConnection(*address, timeout=TIMEOUT_S)
        ok = status == 200 and tokens is not None
        ttft = first - start if ok and first is not None else None
        tpot = (last - first) / (tokens - 1) if ok and first is not None and last and tokens and tokens > 1 else None
        log.append((ok, status, tokens or 0, ttft, tpot))
    conn.close()


def run_generations(
    server: Server, prompts: list[str], clients: int, n: int, max_tokens: int, temperature: float
) -> tuple[list, float]:
    """``n`` requests (seeds 0..n-1, prompts in turn) from ``clients`` threads: the log and the wall time."""
    jobs = [(i, prompts[i % len(prompts)]) for i in range(n)][::-1]
    log: list = []
    work = (server.address, jobs, threading.Lock(), max_tokens, temperature, log)
    return log, timed_clients(generate_loop, work, clients)


def generation_phase(server: Server, prompts: list[str], clients: int, args: argparse.Namespace) -> dict:
    """One phase: a warm-up (each client one 8-token request, not measured), then the measured requests."""
    run_generations(server, prompts[::-1], clients, clients, min(8, args.max_tokens), args.temperature)
    n = phase_requests(args, clients)
    log, wall = run_generations(server, prompts, clients, n, args.max_tokens, args.temperature)
    tokens = sum(count for ok, _, count, _, _ in log if ok)
    ttft = sorted(t for ok, _, _, t, _ in log if ok and t is not None)
    tpot = sorted(t for ok, _, _, _, t in log if ok and t is not None)
    ok = sum(1 for entry in log if entry[0])
    return {
        "clients": clients,
        "requests": len(log),
        "ok": ok,
        "failed": len(log) - ok,
        "failures": sorted({str(status) for good, status, *_ in log if not good}),
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "time_to_first_token_s": {"p50": rounded(percentile(ttft, 50)), "p99": rounded(percentile(ttft, 99))},
        "time_per_output_token_s": {"p50": rounded(percentile(tpot, 50)), "p99": rounded(percentile(tpot, 99))},
    }


def rounded(value: float) -> float | None:
    """``value`` to 5 places; None for nan (no request measured it)."""
    return None if value != value else round(value, 5)


def ratios(phases: list[dict], clients: list[int]) -> dict[str, float | None]:
    """Continuous (1 worker) over one-at-a-time tokens/s at each client count; None where one is missing."""
    rate = {(p["mode"], p["workers"], p["clients"]): p["tokens_per_s"] for p in phases}
    found = {}
    for c in clients:
        on, off = rate.get(("continuous", 1, c)), rate.get(("one_at_a_time", 1, c))
        found[str(c)] = round(on / off, 2) if on is not None and off else None
    return found


if __name__ == "__main__":
    sys.exit(main())
