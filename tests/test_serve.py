"""``qkv serve``: request validation, HTTP status codes, and the command bound to 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import qkv
from qkv.viz.explorers import EncoderExplorer
from qkv.viz.server import MAX_BODY_BYTES, ExplorerApp, RequestError, make_server

WORDS = ["the", "a", "dog", "cat", "runs", "sleeps", "on", "mat", "beach", "time", "flies", "like", "an", "arrow"]


def make_tiny_bert(folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    config = transformers.BertConfig(
        vocab_size=len(WORDS) + 5,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=24,
    )
    torch.manual_seed(2)
    transformers.BertModel(config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="module")
def app(tiny_bert_dir):
    explorer = EncoderExplorer(model=qkv.load_pretrained(tiny_bert_dir, device="cpu"), name="tiny-bert")
    return ExplorerApp(explorers={"tiny-bert": explorer}, max_chars=40, initial_text="the dog runs")


@pytest.fixture(scope="module")
def server(app):
    httpd = make_server(app, host="127.0.0.1", port=0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[:2]
    httpd.shutdown()
    httpd.server_close()


def request(address, method, path, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type"), response.read()
    finally:
        conn.close()


def post_json(address, payload) -> tuple[int, dict]:
    status, ctype, body = request(
        address, "POST", "/api/attend", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    assert ctype.startswith("application/json")
    return status, json.loads(body)


def test_app_validates_requests(app):
    example = app.attend({"text": "the cat sleeps", "model": "tiny-bert"})["example"]
    assert example["views"][0]["queries"] == ["[CLS]", "the", "cat", "sleeps", "[SEP]"]
    bad = [
        (["not", "an", "object"], "JSON object"),
        ({"model": "tiny-bert"}, "non-empty string"),
        ({"text": "   "}, "non-empty string"),
        ({"text": 5}, "non-empty string"),
        ({"text": "x" * 41}, "41 characters; the limit is 40"),
        ({"text": "the dog", "model": "../../etc"}, "started with: tiny-bert"),
        ({"text": "the dog", "extra": 1}, "unknown fields"),
        ({"text": "the dog", "target": "a"}, "translation model only"),
    ]
    for payload, message in bad:
        with pytest.raises(RequestError, match=message) as err:
            app.attend(payload)
        assert err.value.status == 400


def test_http_routes_and_errors(server):
    status, ctype, body = request(server, "GET", "/")
    assert status == 200 and ctype.startswith("text/html")
    page = body.decode()
    assert "connect-src 'self'" in page and '"endpoint":"/api/attend"' in page
    status, _, body = request(server, "GET", "/api/models")
    assert status == 200 and json.loads(body) == {"models": ["tiny-bert"], "max_chars": 40}
    status, payload = post_json(server, {"text": "a dog runs", "model": "tiny-bert"})
    assert status == 200 and payload["example"]["views"][0]["keys"][1:4] == ["a", "dog", "runs"]
    status, payload = post_json(server, {"text": "x" * 100})
    assert status == 400 and "limit is 40" in payload["error"]
    status, payload = post_json(server, {"text": "a dog runs", "compare": "the dog sleeps"})  # two sentences
    assert status == 200 and [e["text"] for e in payload["examples"]] == ["a dog runs", "the dog sleeps"]
    assert payload["compare"]["shared"] == [[0, 0], [2, 2], [4, 4]] and "stats" in payload["example"]["views"][0]
    status, payload = post_json(server, {"text": "a dog", "compare": "x" * 41})
    assert status == 400 and "'compare' has 41 characters" in payload["error"]
    status, _, body = request(server, "POST", "/api/attend", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]
    status, _, body = request(server, "POST", "/api/attend", b"x" * (MAX_BODY_BYTES + 1))
    assert status == 413 and "limit" in json.loads(body)["error"]
    status, _, body = request(server, "GET", "/api/attend")
    assert status == 405
    status, _, body = request(server, "GET", "/secret/../../file")
    assert status == 404 and "error" in json.loads(body)
    conn = http.client.HTTPConnection(*server, timeout=30)  # a POST without Content-Length
    conn.putrequest("POST", "/api/attend")
    conn.endheaders()
    assert conn.getresponse().status == 411
    conn.close()


def test_serve_command_binds_localhost(tiny_bert_dir, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-c",
        "import sys; from qkv.cli import main; sys.exit(main())",
        "serve",
        "--model",
        str(tiny_bert_dir),
        "--port",
        "0",
        "--text",
        "a cat",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        stderr = proc.stderr.read() if proc.poll() is not None else ""
        assert "serving the attention explorer on http://127.0.0.1:" in line, (line, stderr)
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        with urllib.request.urlopen(url + "api/models", timeout=30) as response:
            assert json.load(response)["models"] == ["tiny-bert"]
        with urllib.request.urlopen(url, timeout=30) as response:
            assert '"text":"a cat"' in response.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_command_fails_cleanly_on_a_bad_model(tmp_path):
    cmd = [
        sys.executable,
        "-c",
        "import sys; from qkv.cli import main; sys.exit(main())",
        "serve",
        "--model",
        str(tmp_path / "missing"),
        "--port",
        "0",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("qkv serve: error:") and "\n" not in result.stderr.strip()


# --- hardening: malformed bodies, every method, timeouts, the connection cap ----------------------

HANG_GUARD_S = 8.0  # a socket read that takes longer than this means the server hung (never a timing assertion)


@contextmanager
def serving(app, **limits):
    """A server for ``app`` with the given limits (``timeout=``, ``max_concurrent=``) on a free port."""
    httpd = make_server(app, host="127.0.0.1", port=0, **limits)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def exchange(address, method, path, body: bytes | None = None, headers: dict | None = None):
    """One request; returns (status, headers, body)."""
    conn = http.client.HTTPConnection(*address, timeout=HANG_GUARD_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(HANG_GUARD_S)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    finally:
        sock.close()
    return b"".join(chunks)


def raw_exchange(address, data: bytes) -> bytes:
    sock = socket.create_connection(address, timeout=HANG_GUARD_S)
    sock.sendall(data)
    return read_until_closed(sock)


def parse_raw(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/"), raw[:200]
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def assert_json_error(headers, body: bytes) -> str:
    assert headers["Content-Type"].startswith("application/json"), (headers, body[:200])
    message = json.loads(body)["error"]
    assert isinstance(message, str) and message and "\n" not in message and "Traceback" not in message
    return message


def stall(address, *, sent: bytes = b'{"text": "the', length: int = 100) -> socket.socket:
    """A slow client: a POST whose headers promise ``length`` bytes of body, then only ``sent``."""
    sock = socket.create_connection(address, timeout=HANG_GUARD_S)
    sock.sendall(
        b"POST /api/attend HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (length, sent)
    )
    return sock


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_app_rejects_unhashable_models_and_lone_surrogates(app):
    for payload, message in [
        ({"text": "the dog", "model": ["tiny-bert"]}, "'model' must be a string"),
        ({"text": "the dog", "model": {"name": "tiny-bert"}}, "'model' must be a string"),
        ({"text": "the \ud800 dog"}, "not valid Unicode"),
    ]:
        with pytest.raises(RequestError, match=message) as err:
            app.attend(payload)
        assert err.value.status == 400


def test_bad_bodies_are_400_json_not_500(server):
    bodies = [
        b'{"text": "the dog", "model": ["tiny-bert"]}',
        b'{"text": "the dog", "model": {"a": 1}}',
        b'{"text": "the \\ud800 dog"}',  # JSON accepts a lone surrogate; UTF-8 cannot encode it
        b"[" * 8000 + b"]" * 8000,  # deeper than json's recursion limit
        b'{"text": ' + b"1" * 5000 + b"}",  # more digits than Python converts to an int
    ]
    for body in bodies:
        status, headers, reply = exchange(server, "POST", "/api/attend", body, {"Content-Type": "application/json"})
        assert status == 400, (body[:60], reply[:200])
        assert_json_error(headers, reply)
    # a body shorter than its Content-Length, the client then closing its side
    sock = stall(server, sent=b'{"text"', length=50)
    sock.shutdown(socket.SHUT_WR)
    status, headers, reply = parse_raw(read_until_closed(sock))
    assert status == 400 and "Content-Length" in assert_json_error(headers, reply)


def test_every_method_and_path_gets_a_json_answer(server):
    for method in ("PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "BREW"):
        status, headers, body = exchange(server, method, "/api/attend", b"{}")
        assert status == 405 and headers["Allow"] == "POST", (method, status, body[:200])
        assert method in assert_json_error(headers, body)
        status, headers, body = exchange(server, method, "/")
        assert status == 405 and headers["Allow"] == "GET, HEAD"
        assert_json_error(headers, body)
        status, headers, body = exchange(server, method, "/no/such/page")
        assert status == 404
        assert_json_error(headers, body)
    status, headers, body = exchange(server, "POST", "/api/models", b"{}")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    # HEAD: the GET answer's status and headers, no body
    for path, expected in [("/api/models", 200), ("/", 200), ("/api/attend", 405), ("/nowhere", 404)]:
        status, headers, body = parse_raw(raw_exchange(server, b"HEAD %s HTTP/1.0\r\n\r\n" % path.encode()))
        assert status == expected and body == b"", (path, status, body[:100])
        assert int(headers["Content-Length"]) > 0


def test_malformed_requests_get_a_json_answer(server):
    many_headers = b"".join(b"X-%d: 1\r\n" % i for i in range(120))
    cases = [
        (b"NONSENSE\r\n\r\n", 400),
        (b"GET / HTTP/1.1 extra\r\n\r\n", 400),
        (b"GET / HTTP/1.x\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\n" + many_headers + b"\r\n", 431),
        (b"POST /api/attend HTTP/1.1\r\nContent-Length: 1_0\r\n\r\n{}", 400),
    ]
    for raw, expected in cases:
        status, headers, body = parse_raw(raw_exchange(server, raw))
        assert status == expected, (raw[:40], status, body[:200])
        assert_json_error(headers, body)


def test_server_errors_are_json_without_details(app):
    class Broken:
        kind, name = "encoder", "broken"

        def example(self, text):
            raise RuntimeError("secret detail\nTraceback (most recent call last)")

    broken = ExplorerApp(explorers={"broken": Broken()}, max_chars=40)
    with serving(broken, timeout=5, max_concurrent=4) as httpd:
        status, headers, body = exchange(httpd.server_address[:2], "POST", "/api/attend", b'{"text": "a dog"}')
    assert status == 500 and "secret" not in body.decode()
    assert_json_error(headers, body)


def test_stalled_connections_time_out_while_others_are_served(app):
    with serving(app, timeout=0.5, max_concurrent=8) as httpd:
        address = httpd.server_address[:2]
        body_stall = stall(address)  # the headers, then part of the body
        head_stall = socket.create_connection(address, timeout=HANG_GUARD_S)
        head_stall.sendall(b"POST /api/attend HTTP/1.1\r\nContent-Len")  # part of the headers
        idle = socket.create_connection(address, timeout=HANG_GUARD_S)  # nothing at all
        status, payload = post_json(address, {"text": "the dog runs"})
        assert status == 200 and "example" in payload
        for sock in (body_stall, head_stall):
            status, headers, body = parse_raw(read_until_closed(sock))
            assert status == 408
            assert "0.5 s" in assert_json_error(headers, body)
        assert read_until_closed(idle) == b""  # nothing was asked, so nothing is answered: closed
        wait_for(lambda: httpd.active_connections == 0, "the stalled connections to be released")
        assert post_json(address, {"text": "a cat sleeps"})[0] == 200


def test_connections_beyond_the_cap_get_503_json(app):
    with serving(app, timeout=5, max_concurrent=1) as httpd:
        address = httpd.server_address[:2]
        slow = stall(address)
        wait_for(lambda: httpd.active_connections == 1, "the server to take the stalled connection")
        status, headers, body = exchange(address, "POST", "/api/attend", b'{"text": "a dog"}')
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert "busy" in assert_json_error(headers, body)
        status, headers, body = exchange(address, "GET", "/api/models")
        assert status == 503
        slow.close()  # the slot comes back as soon as the slow client goes, not after the timeout
        wait_for(lambda: httpd.active_connections == 0, "the slot to be released")
        assert post_json(address, {"text": "a dog"})[0] == 200


def test_limits_are_checked(app, tmp_path, capsys):
    from qkv.cli import main

    for limits in ({"timeout": 0}, {"timeout": float("nan")}, {"max_concurrent": 0}, {"max_concurrent": 2.5}):
        with pytest.raises(ValueError, match=next(iter(limits))):
            make_server(app, host="127.0.0.1", port=0, **limits)
    missing = str(tmp_path / "missing-model")  # the options are checked before any model is opened
    for args, flag in [
        (["--timeout", "0"], "--timeout"),
        (["--timeout", "-1"], "--timeout"),
        (["--timeout", "nan"], "--timeout"),
        (["--max-concurrent", "0"], "--max-concurrent"),
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--max-chars", "0"], "--max-chars"),
    ]:
        assert main(["serve", "--model", missing, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("qkv serve: error:") and flag in err and "\n" not in err, err
