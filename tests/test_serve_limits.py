"""``qkv serve`` under clients that go, stall or flood: abandoned requests are cancelled (queued work
never runs, a running generation stops), each model's queue is bounded (503 + Retry-After), stalled
connections time out (408) and are capped below the open-file limit, and requests are checked before
any work (Host 421, Content-Type 415, bodies 413 read to the end, sampling options 422)."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_serve import HANG_GUARD_S, make_tiny_bert, wait_for

from qkv.serve.batching import DecodeKey, ModelWorker, TranslationBatcher
from qkv.serve.models import Limits, open_models
from qkv.serve.server import allowed_hosts, make_server, show_address
from qkv.viz.app import ExplorerApp

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from qkv.serve.app import create_app  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
PROMPT = "First Citizen:\n"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve_limits")
    return shutil.copytree(FIXTURES / "lm_run", root / "lm"), make_tiny_bert(root / "tiny-bert")


@pytest.fixture(scope="module")
def models(model_dirs):
    return open_models(list(model_dirs))


def explorer_of(models) -> ExplorerApp:
    return ExplorerApp(explorers={name: m.explorer for name, m in models.items()}, max_chars=200)


@contextmanager
def serving(models, **limits) -> Iterator[tuple[tuple[str, int], object]]:
    """A real uvicorn server on a free port of 127.0.0.1; yields its address and its app's Service."""
    httpd = make_server(explorer_of(models), models=models, host="127.0.0.1", port=0, limits=Limits(**limits))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    wait_for(lambda: httpd.uvicorn.started, "the server to start")
    try:
        yield httpd.server_address[:2], httpd.uvicorn.config.app.state.service
    finally:
        httpd.shutdown()
        httpd.server_close()


def exchange(address, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection(*address, timeout=HANG_GUARD_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def health(address) -> dict:
    status, _, body = exchange(address, "GET", "/health")
    assert status == 200
    return json.loads(body)


def raw_request(path: str, payload: dict, host: str = "127.0.0.1") -> bytes:
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


class Steps:
    """Counts the served language model's forward passes (one request alone: one a token, its
    prompt's included), and can hold the model thread at a step until the test lets it go."""

    def __init__(self, model, monkeypatch, *, hold_at: int | None = None) -> None:
        self.count, self.hold_at = 0, hold_at
        self.reached, self.release = threading.Event(), threading.Event()
        forward = model.forward

        def counting(*args, **options):
            self.count += 1
            if self.count == self.hold_at:
                self.reached.set()
                assert self.release.wait(HANG_GUARD_S)
            return forward(*args, **options)

        monkeypatch.setattr(model, "forward", counting)


def hold_model_thread(service) -> threading.Event:
    """Occupy the one model thread until the returned event is set."""
    release = threading.Event()
    service.worker.submit(release.wait, HANG_GUARD_S)
    return release


def test_abandoned_requests_never_run_and_the_next_is_answered(models, monkeypatch):
    """20 non-streamed generations of 512 tokens, each sent and its socket closed while the model
    thread is busy: none of them samples a single token, the server counts 20 cancelled, and the next
    request is answered."""
    steps = Steps(models["lm"].model, monkeypatch)
    with serving(models) as (address, service):
        release = hold_model_thread(service)
        request = raw_request("/v1/generate", {"prompt": PROMPT, "max_tokens": 512, "stream": False})
        for _ in range(20):
            with socket.create_connection(address, timeout=HANG_GUARD_S) as sock:
                sock.sendall(request)
        wait_for(lambda: health(address)["cancelled_requests"] == 20, "the 20 abandoned requests to be cancelled")
        assert health(address)["queued"]["lm"] == 0
        release.set()
        body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "stream": False, "temperature": 0}).encode()
        status, _, answer = exchange(address, "POST", "/v1/generate", body, JSON)
        assert status == 200 and json.loads(answer)["tokens"] == 8
    assert steps.count == 8  # the valid request's tokens, and not one of the 20 * 512 abandoned


def test_a_running_generation_stops_when_its_client_goes(models, monkeypatch):
    steps = Steps(models["lm"].model, monkeypatch, hold_at=3)
    with serving(models) as (address, service):
        with socket.create_connection(address, timeout=HANG_GUARD_S) as sock:
            sock.sendall(raw_request("/v1/generate", {"prompt": PROMPT, "max_tokens": 512, "stream": False}))
            assert steps.reached.wait(HANG_GUARD_S)  # it runs: 3 tokens sampled
        wait_for(lambda: health(address)["cancelled_requests"] == 1, "the generation to be cancelled")
        steps.release.set()
        body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "stream": False}).encode()
        assert exchange(address, "POST", "/v1/generate", body, JSON)[0] == 200  # the model thread is free again
    assert steps.count in (2 + 3, 2 + 4)  # the abandoned one stopped at the token after its client went


def test_abandoned_embeddings_and_explorer_requests_never_run(models):
    with serving(models) as (address, service):
        release = hold_model_thread(service)
        for request in [
            raw_request("/v1/embed", {"texts": ["the dog runs"]}),
            raw_request("/api/attend", {"text": "the dog runs", "model": "tiny-bert"}),
        ]:
            with socket.create_connection(address, timeout=HANG_GUARD_S) as sock:
                sock.sendall(request)
        wait_for(lambda: health(address)["cancelled_requests"] == 2, "both requests to be cancelled")
        release.set()
        assert health(address)["queued"] == {"lm": 0, "tiny-bert": 0, "explorer": 0}


def test_a_full_queue_answers_503_with_retry_after(models):
    with serving(models, max_queue=3) as (address, service):
        release = hold_model_thread(service)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "stream": False}).encode()
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(exchange(address, "POST", "/v1/generate", body, JSON)[0]))
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: health(address)["queued"]["lm"] == 3, "3 requests in the queue")
        for stream in (False, True):
            full = json.dumps({"prompt": PROMPT, "max_tokens": 2, "stream": stream}).encode()
            status, headers, answer = exchange(address, "POST", "/v1/generate", full, JSON)
            assert status == 503 and headers["Retry-After"] == "1", answer
            assert "its limit; retry later" in json.loads(answer)["error"]
        release.set()
        for thread in threads:
            thread.join(HANG_GUARD_S)
        assert results == [200, 200, 200]


def test_batcher_skips_requests_whose_client_went():
    """Translation requests cancelled before their batch is decoded leave it: the decoder never sees
    their texts, and the others get their own translations."""
    decoded: list[list[str]] = []

    def decode(texts: list[str], key: DecodeKey) -> list[str]:
        decoded.append(list(texts))
        return [text.upper() for text in texts]

    async def scenario() -> list:
        worker = ModelWorker()
        batcher = TranslationBatcher(decode, worker, max_wait_s=0.05, max_tokens=10_000)
        release = threading.Event()
        worker.submit(release.wait, HANG_GUARD_S)  # the model thread is busy while the batch forms
        key = DecodeKey(1, 0.6, "gnmt")
        tasks = [asyncio.ensure_future(batcher.translate([f"s{i}"], key, 2)) for i in range(6)]
        while len(batcher._pending) < 6:  # all six queued
            await asyncio.sleep(0.001)
        while batcher._pending:  # then taken as one batch, which waits for the model thread
            await asyncio.sleep(0.001)
        for i in (1, 2, 4):
            tasks[i].cancel()
        await asyncio.sleep(0.01)
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        worker.close()
        return [batcher.skipped, batcher.batches, results]

    skipped, batches, results = asyncio.run(scenario())
    assert decoded == [["s0", "s3", "s5"]] and (skipped, batches) == (3, 1)
    assert results[0] == ["S0"] and results[3] == ["S3"] and results[5] == ["S5"]
    assert all(isinstance(results[i], asyncio.CancelledError) for i in (1, 2, 4))


# --- connections: read timeouts and the cap ------------------------------------------------------------


@pytest.mark.parametrize(
    "sent",
    [b"", b"P", b"POST /v1/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"],
    ids=["nothing", "one byte", "half the headers"],
)
def test_a_connection_that_stalls_before_its_headers_gets_408_and_is_closed(models, sent):
    with serving(models, header_timeout_s=0.3) as (address, service):
        with socket.create_connection(address, timeout=HANG_GUARD_S) as sock:
            sock.sendall(sent)
            answer = read_all(sock)  # returns once the server closes the connection
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert "headers did not arrive" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert health(address)["connections"]["timed_out"] == 1


def test_a_body_that_stalls_gets_408_and_the_server_goes_on(models):
    with serving(models, body_timeout_s=0.3) as (address, service):
        with socket.create_connection(address, timeout=HANG_GUARD_S) as sock:
            sock.sendall(
                b"POST /v1/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"texts": ['
            )
            answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"body did not arrive" in answer
        assert exchange(address, "POST", "/v1/embed", b'{"texts": ["a dog"]}', JSON)[0] == 200


STALLS = [  # what a stalled client sends: nothing, one byte, half the headers, the headers and no body
    b"",
    b"G",
    b"POST /v1/embed HTTP/1.1\r\nHost: 127.0.0.1\r\n",
    b"POST /v1/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n",
]


def test_more_stalled_connections_than_the_cap_leave_room_for_a_valid_request(models):
    """Past the cap, a new connection closes the one that has waited longest for its client: 40
    stalled connections (:data:`STALLS`) against a cap of 8, then /health answers."""
    with serving(models, max_connections=8) as (address, service):
        stalled = []
        for i in range(40):
            sock = socket.create_connection(address, timeout=HANG_GUARD_S)
            sock.sendall(STALLS[i % len(STALLS)])
            stalled.append(sock)
        report = health(address)["connections"]
        assert report["max"] == 8 and report["open"] <= 8 and report["evicted"] == 40 + 1 - 8, report
        for sock in stalled:
            sock.close()


def test_stalled_connections_past_the_open_file_limit_do_not_stop_accept(model_dirs, tmp_path):
    """``qkv serve`` with an open-file limit of 256 and 300 stalled connections: the cap, derived from
    the limit, keeps accept from failing (EMFILE) and /health is answered."""
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
        "from qkv.cli import main; sys.exit(main())"
    )
    cmd = [sys.executable, "-c", code, "serve", "--model", str(model_dirs[0]), "--port", "0", "--threads", "1"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    stalled: list[socket.socket] = []
    try:
        line = proc.stdout.readline()
        assert "serving on http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.split("127.0.0.1:", 1)[1].split("/", 1)[0])
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)
            sock.sendall(STALLS[i % len(STALLS)])
            stalled.append(sock)
        status, _, body = exchange(("127.0.0.1", port), "GET", "/health")
        report = json.loads(body)["connections"]
        assert status == 200 and report["max"] < 256 - 64 and report["open"] <= report["max"], report

        def seen() -> dict:  # once the server has accepted every connection (some may still wait in the kernel)
            report = json.loads(exchange(("127.0.0.1", port), "GET", "/health")[2])["connections"]
            return report if sum(report[k] for k in ("open", "evicted", "timed_out", "refused")) >= 301 else {}

        wait_for(seen, "the server to accept every connection")
        report = seen()
        assert report["open"] <= report["max"] and report["evicted"] >= 300 - report["max"], json.dumps(report)
    finally:
        for sock in stalled:
            sock.close()
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "Too many open files" not in stderr and "Traceback" not in stderr, stderr[-2000:]


def test_old_and_new_connection_options_are_checked(capsys):
    from qkv.cli import main

    for args, flag in [
        (["--max-queue", "0"], "--max-queue"),
        (["--max-connections", "-2"], "--max-connections"),
        (["--header-timeout", "0"], "--header-timeout"),
        (["--body-timeout", "nan"], "--body-timeout"),
    ]:
        assert main(["serve", "--model", "/nonexistent/model", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("qkv serve: error:") and flag in err and "\n" not in err, err
    with pytest.raises(ValueError, match="does not fit"):
        from qkv.serve.connections import connection_cap

        connection_cap(10**9)


# --- requests checked before any work -------------------------------------------------------------------


def test_host_names_are_checked_on_a_loopback_server(models):
    with serving(models) as (address, service):
        port = address[1]
        for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LOCALHOST"):
            assert exchange(address, "GET", "/health", headers={"Host": host})[0] == 200, host
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "[::2]"):
            status, headers, body = exchange(address, "GET", "/health", headers={"Host": host})
            assert status == 421 and "--allow-host" in json.loads(body)["error"], host
            status, _, _ = exchange(address, "POST", "/v1/embed", b'{"texts": ["a dog"]}', {**JSON, "Host": host})
            assert status == 421
    assert allowed_hosts("127.0.0.1", ["box.lan"]) == ["localhost", "127.0.0.1", "[::1]", "box.lan"]
    assert allowed_hosts("0.0.0.0") is None and "box.lan" in allowed_hosts("0.0.0.0", ["box.lan"])


def test_ipv6_addresses_are_shown_in_brackets():
    assert show_address("::", 8000) == "[::]:8000" and show_address("::1") == "[::1]"
    assert show_address("", 8000) == "0.0.0.0:8000" and show_address("10.0.0.2", 80) == "10.0.0.2:80"


def test_a_body_over_the_limit_is_read_and_answered_413(models):
    """A client that sends all of a 1 MiB body before reading the answer reads the 413, not a reset."""
    with serving(models, max_body_bytes=8192) as (address, service):
        body = json.dumps({"texts": ["the dog runs " * 40] * 2000}).encode()
        for length in (True, False):  # with a Content-Length, or chunked (the size is known only as read)
            with socket.create_connection(address, timeout=HANG_GUARD_S) as sock:
                head = b"POST /v1/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                if length:
                    sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
                else:
                    chunks = b"".join(
                        b"%x\r\n%s\r\n" % (len(c), c) for c in (body[i : i + 4096] for i in range(0, len(body), 4096))
                    )
                    sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
                response = http.client.HTTPResponse(sock)
                response.begin()
                assert response.status == 413 and "the limit is 8192" in json.loads(response.read())["error"]
                # the body was read to its end: the connection takes the next request
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                response = http.client.HTTPResponse(sock)
                response.begin()
                assert response.status == 200 and json.loads(response.read())["status"] == "ok"


@pytest.fixture(scope="module")
def client(models):
    app = create_app(models, explorer_of(models), Limits(max_chars=200))
    with TestClient(app, raise_server_exceptions=True) as client:  # a fault that escaped would raise here
        yield client


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "Infinity"), ("temperature", "1e-300"), ("top_p", "1e-300"), ("temperature", "1e9")],
)
def test_sampling_options_out_of_range_are_422_before_any_work(client, stream, field, value):
    body = f'{{"prompt": "{PROMPT.strip()}", "max_tokens": 4, "stream": {str(stream).lower()}, "{field}": {value}}}'
    response = client.post("/v1/generate", content=body.encode(), headers=JSON)
    assert response.status_code == 422 and response.headers["content-type"].startswith("application/json")
    message = response.json()["error"]
    assert field in message and "--" not in message and "\n" not in message, message


def test_embedding_a_text_longer_than_the_model_reads_is_413(client):
    ok = client.post("/v1/embed", json={"texts": ["the dog runs"]})
    assert ok.status_code == 200
    response = client.post("/v1/embed", json={"texts": ["the dog runs", "the dog runs " * 10]})  # 24 positions
    assert (
        response.status_code == 413
        and "texts[1]" in response.json()["error"]
        and "at most 24" in response.json()["error"]
    )


def test_a_fault_is_answered_500_and_logged_once(models, caplog):
    class Broken:
        kind, name = "encoder", "broken"
        model = tokenizer = None

        def example(self, text):
            raise RuntimeError("secret detail")

    explorer = ExplorerApp(explorers={"broken": Broken()}, max_chars=40)
    app = create_app({}, explorer, Limits())
    with caplog.at_level(logging.ERROR), TestClient(app, raise_server_exceptions=True) as client:
        response = client.post("/api/attend", content=b'{"text": "a dog"}', headers=JSON)
    assert response.status_code == 500 and "secret" not in response.text
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert len(tracebacks) == 1 and "secret detail" in str(tracebacks[0].exc_info[1])


def test_json_endpoints_refuse_other_content_types(client):
    for path, body in [
        ("/v1/generate", {"prompt": "a"}),
        ("/v1/embed", {"texts": ["a"]}),
        ("/api/attend", {"text": "a"}),
    ]:
        for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
            response = client.post(path, content=json.dumps(body).encode(), headers=headers)
            assert response.status_code == 415, (path, headers, response.text)
            assert "Content-Type: application/json" in response.json()["error"]
