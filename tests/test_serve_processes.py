"""``qkv serve`` as processes: ``--engine ctranslate2`` (its translations are what ``qkv translate
--engine ctranslate2`` writes), ``--workers N`` (N processes answering on one port, one startup line, a
worker's failure failing the command) and the drain on SIGTERM (requests in flight finish, new ones
are refused or answered 503, ``/health`` says ``draining``; past ``--drain-timeout`` a generation is
cut and the process still exits 0). Live servers are real ``python -m qkv serve`` processes, read
with the standard library's HTTP client."""

from __future__ import annotations

import http.client
import json
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_serve_api import SENTENCES, TRAIN

from qkv.cli import main
from qkv.serve.models import Limits, open_models
from qkv.viz.app import ExplorerApp

pytest.importorskip("fastapi")
pytest.importorskip("ctranslate2")
from fastapi.testclient import TestClient  # noqa: E402

from qkv.cli.serve import startup_line  # noqa: E402
from qkv.serve.app import create_app  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
PROMPT = "First Citizen:\n"
WAIT_S = 120.0  # a server that takes longer than this to start or stop has hung (never a timing assertion)


@pytest.fixture(scope="module")
def translator_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("serve_processes") / "en-de"
    assert main([*TRAIN, "--run-dir", str(run)]) == 0
    torch.set_num_threads(1)  # the CLI call set all cores (see conftest)
    return run


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    return shutil.copytree(FIXTURES / "lm_run", tmp_path_factory.mktemp("serve_processes_lm") / "lm")


def translate_command(run: Path, tmp_path: Path, *flags: str) -> list[str]:
    """What ``qkv translate RUN --engine ctranslate2 FLAGS`` writes for SENTENCES."""
    source, out = tmp_path / "source.txt", tmp_path / "out.txt"
    source.write_text("".join(s + "\n" for s in SENTENCES))
    assert main(["translate", str(run), str(source), "-o", str(out), "--engine", "ctranslate2", *flags]) == 0
    torch.set_num_threads(1)
    return out.read_text().splitlines()


def test_ctranslate2_engine_serves_what_qkv_translate_writes(translator_run, lm_run, tmp_path):
    models = open_models([translator_run, lm_run], engine="ctranslate2", threads=1)
    explorer = ExplorerApp(explorers={name: m.explorer for name, m in models.items()}, max_chars=200)
    with TestClient(create_app(models, explorer, Limits()), raise_server_exceptions=False) as client:
        health = client.get("/health").json()
        assert health["engines"] == {"en-de": "ctranslate2", "lm": "qkv"}  # the language model keeps qkv's
        for flags, body in [
            (["--beam", "1"], {"beam_size": 1}),
            (["--beam", "4", "--alpha", "0.6"], {"beam_size": 4, "alpha": 0.6}),
        ]:
            answer = client.post("/v1/translate", json={"texts": SENTENCES, **body}).json()
            expected = translate_command(translator_run, tmp_path, *flags)
            assert answer["translations"] == expected and len(set(expected)) > 1, flags
            assert answer["penalty"] == "power"  # CTranslate2's only form, its default here
        assert client.get("/health").json()["translation_batches"]["en-de"] == 2  # through the batcher
        refused = client.post("/v1/translate", json={"texts": SENTENCES[:1], "beam_size": 4, "penalty": "gnmt"})
        assert refused.status_code == 422
        assert "CTranslate2 divides by len ** alpha only" in refused.json()["error"]
        assert client.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 5}).status_code == 200


def test_the_startup_line_names_the_engine_and_what_it_does_not_decode():
    args = type("Args", (), {"max_batch_wait": 5.0, "engine": "ctranslate2", "workers": 2})()
    listing = {"en-de": {"endpoint": "/v1/translate", "engine": "ctranslate2"}}
    listing["lm"] = {"endpoint": "/v1/generate", "engine": "qkv"}
    line = startup_line(("127.0.0.1", 8000), listing, args)
    assert line.startswith("serving on http://127.0.0.1:8000/ (models: en-de (/v1/translate), lm (/v1/generate)")
    assert "translations decoded by ctranslate2 (lm: qkv's engine)" in line and "2 worker processes" in line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "--workers must be between 1 and 64"),
        (["--drain-timeout", "-1"], "--drain-timeout must be between 0 and 3600"),
        (["--drain-timeout", "nan"], "--drain-timeout must be between 0 and 3600"),
    ],
)
def test_process_options_out_of_range_are_refused(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


# --- live servers --------------------------------------------------------------------------------


def start(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, tuple[str, int], str]:
    """``python -m qkv serve --port 0 FLAGS``; returns the process, its address and its first line."""
    log = (tmp_path / "stderr.txt").open("w")
    cmd = [sys.executable, "-m", "qkv", "serve", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    line = proc.stdout.readline() if ready else ""
    assert line.startswith("serving on http://"), (line, (tmp_path / "stderr.txt").read_text())
    host, port = line.split("http://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    return proc, (host, int(port)), line


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(WAIT_S)


def ask(sock: socket.socket, method: str = "GET", path: str = "/health", body: bytes = b"") -> tuple:
    """One request on an open connection; (status, headers, body) as http.client reads them."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.headers, response.read()


def generation_rate(address: tuple[str, int]) -> float:
    """The server's tokens a second, greedy, from one 300-token generation."""
    conn = http.client.HTTPConnection(*address, timeout=WAIT_S)
    body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": False}
    started = time.monotonic()
    conn.request("POST", "/v1/generate", json.dumps(body), {"Content-Type": "application/json"})
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return answer["tokens"] / (time.monotonic() - started)


def open_stream(address: tuple[str, int], max_tokens: int) -> http.client.HTTPResponse:
    """A streamed generation of ``max_tokens`` greedy tokens, its first text event read."""
    conn = http.client.HTTPConnection(*address, timeout=WAIT_S)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/generate", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    while not response.readline().startswith(b"data:"):
        pass
    return response


def test_sigterm_lets_a_stream_finish_and_refuses_new_work(lm_run, tmp_path):
    proc, address, _ = start(tmp_path, "--model", str(lm_run), "--max-new-tokens", "1000000", "--threads", "1")
    try:
        tokens = int(generation_rate(address) * 3) + 300  # about three seconds of generation
        idle = socket.create_connection(address, timeout=WAIT_S)  # open before the signal, kept alive
        other = socket.create_connection(address, timeout=WAIT_S)
        assert ask(idle)[0] == 200 and ask(other)[0] == 200
        stream = open_stream(address, tokens)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        while (answer := ask(idle))[0] == 200:  # answered before the server saw the signal
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, headers, body = answer
        assert (status, json.loads(body), headers["Connection"]) == (503, {"status": "draining"}, "close")
        status, headers, body = ask(other, "POST", "/v1/generate", json.dumps({"prompt": PROMPT}).encode())
        assert (status, json.loads(body), headers["Connection"]) == (
            503,
            {"error": "the server is shutting down"},
            "close",
        )
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=WAIT_S)
        rest = stream.read().decode()
        done = json.loads(rest.split("event: done\ndata: ", 1)[1].split("\n", 1)[0])
        assert (done["tokens"], done["finish_reason"]) == (tokens, "length")
        assert proc.wait(WAIT_S) == 0
    finally:
        stop(proc)


def test_a_generation_longer_than_the_drain_timeout_is_cut(lm_run, tmp_path):
    flags = ["--model", str(lm_run), "--max-new-tokens", "10000000", "--threads", "1", "--drain-timeout", "1"]
    proc, address, _ = start(tmp_path, *flags)
    try:
        stream = open_stream(address, int(generation_rate(address) * 60) + 300)  # a minute of generation
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rest = stream.read()
        except (http.client.IncompleteRead, ConnectionError) as err:  # the stream cut mid-way
            rest = getattr(err, "partial", b"")
        assert b"event: done" not in rest
        assert proc.wait(WAIT_S) == 0
        assert time.monotonic() - signalled < 20  # the drain (1 s) and the close, not the minute
    finally:
        stop(proc)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_share_the_port_and_stop_on_sigterm(lm_run, tmp_path):
    proc, address, line = start(tmp_path, "--model", str(lm_run), "--workers", "2", "--threads", "1")
    try:
        assert "2 worker processes" in line
        pids: set[int] = set()
        deadline = time.monotonic() + WAIT_S
        while len(pids) < 2:  # each new connection goes to one worker or the other
            assert time.monotonic() < deadline, pids
            with socket.create_connection(address, timeout=WAIT_S) as sock:
                status, _, body = ask(sock)
            assert status == 200
            pids.add(json.loads(body)["pid"])
        assert proc.pid not in pids and all(alive(pid) for pid in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        assert "serving on" not in proc.stdout.read()  # one startup line, the parent's
        deadline = time.monotonic() + WAIT_S
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "the workers outlived their parent"
            time.sleep(0.05)
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_worker_that_cannot_open_its_models_fails_the_command(tmp_path):
    cmd = [sys.executable, "-m", "qkv", "serve", "--workers", "2", "--port", "0", "--model", str(tmp_path / "gone")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 2 and "serving on" not in result.stdout
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("qkv serve: error:") and "gone" in error
