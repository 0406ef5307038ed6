"""``qkv serve``'s explorer routes on FastAPI: request validation, HTTP status codes, JSON errors, the
command bound to 127.0.0.1, and stalled clients that block nobody (a real uvicorn server on port 0).
The API routes (/v1/...) are tested in tests/test_serve_api.py."""

from __future__ import annotations

import http.client
import json
import logging
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
from qkv.serve.app import create_app
from qkv.serve.models import Limits, served_model
from qkv.serve.server import make_server
from qkv.viz.app import ExplorerApp, RequestError
from qkv.viz.explorers import EncoderExplorer

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

MAX_BODY_BYTES = 8192
JSON = {"Content-Type": "application/json"}

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


def build_app(explorer_app: ExplorerApp, **limits):
    models = {name: served_model(explorer) for name, explorer in explorer_app.explorers.items()}
    return create_app(models, explorer_app, Limits(max_chars=explorer_app.max_chars, **limits))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(build_app(app, max_body_bytes=MAX_BODY_BYTES), raise_server_exceptions=False) as client:
        yield client


def request(client, method, path, body: bytes | None = None, headers: dict | None = None):
    response = client.request(method, path, content=body, headers=headers or {})
    return response.status_code, response.headers.get("Content-Type"), response.content


def post_json(client, payload) -> tuple[int, dict]:
    status, ctype, body = request(
        client, "POST", "/api/attend", json.dumps(payload).encode(), {"Content-Type": "application/json"}
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


def test_http_routes_and_errors(client):
    status, ctype, body = request(client, "GET", "/")
    assert status == 200 and ctype.startswith("text/html")
    page = body.decode()
    assert "connect-src 'self'" in page and '"endpoint":"/api/attend"' in page
    status, _, body = request(client, "GET", "/api/models")
    assert status == 200 and json.loads(body) == {"models": ["tiny-bert"], "max_chars": 40}
    status, payload = post_json(client, {"text": "a dog runs", "model": "tiny-bert"})
    assert status == 200 and payload["example"]["views"][0]["keys"][1:4] == ["a", "dog", "runs"]
    status, payload = post_json(client, {"text": "x" * 100})
    assert status == 400 and "limit is 40" in payload["error"]
    status, payload = post_json(client, {"text": "a dog runs", "compare": "the dog sleeps"})  # two sentences
    assert status == 200 and [e["text"] for e in payload["examples"]] == ["a dog runs", "the dog sleeps"]
    assert payload["compare"]["shared"] == [[0, 0], [2, 2], [4, 4]] and "stats" in payload["example"]["views"][0]
    status, payload = post_json(client, {"text": "a dog", "compare": "x" * 41})
    assert status == 400 and "'compare' has 41 characters" in payload["error"]
    status, _, body = request(client, "POST", "/api/attend", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]
    status, _, body = request(client, "POST", "/api/attend", b"x" * (MAX_BODY_BYTES + 1))
    assert status == 413 and "limit" in json.loads(body)["error"]
    status, _, body = request(client, "GET", "/api/attend")
    assert status == 405
    status, _, body = request(client, "GET", "/secret/file")
    assert status == 404 and "error" in json.loads(body)
    status, _, body = request(client, "POST", "/api/attend", headers=JSON)  # no body at all
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]
    status, _, body = request(client, "POST", "/api/attend", b'{"text": "a dog"}')  # no Content-Type
    assert status == 415 and "no Content-Type" in json.loads(body)["error"]
    # what a cross-site form may send without the server's consent: never read
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"):
        status, _, body = request(client, "POST", "/api/attend", b'{"text": "a dog"}', {"Content-Type": ctype})
        assert status == 415 and "Content-Type: application/json" in json.loads(body)["error"], ctype


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
        assert "serving on http://127.0.0.1:" in line, (line, stderr)
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


# --- hardening: malformed bodies, every method, server errors, stalled clients, the options -----------

HANG_GUARD_S = 20.0  # a socket read that takes longer than this means the server hung (never a timing assertion)


@contextmanager
def serving(explorer_app: ExplorerApp, **limits):
    """A real uvicorn server for ``explorer_app`` on a free port of 127.0.0.1; yields (host, port)."""
    models = {name: served_model(explorer) for name, explorer in explorer_app.explorers.items()}
    httpd = make_server(
        explorer_app, models=models, host="127.0.0.1", port=0, limits=Limits(max_chars=explorer_app.max_chars, **limits)
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    wait_for(lambda: httpd.uvicorn.started, "the server to start")
    try:
        yield httpd.server_address[:2]
    finally:
        httpd.shutdown()
        httpd.server_close()


def exchange(address, method, path, body: bytes | None = None, headers: dict | None = None):
    """One request on a fresh connection; returns (status, headers, body)."""
    conn = http.client.HTTPConnection(*address, timeout=HANG_GUARD_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def assert_json_error(headers, body: bytes) -> str:
    assert headers["Content-Type"].startswith("application/json"), (headers, body[:200])
    message = json.loads(body)["error"]
    assert isinstance(message, str) and message and "\n" not in message and "Traceback" not in message
    return message


def stall(address, *, sent: bytes = b'{"text": "the', length: int = 100) -> socket.socket:
    """A slow client: a POST whose headers promise ``length`` bytes of body, then only ``sent``."""
    sock = socket.create_connection(address, timeout=HANG_GUARD_S)
    sock.sendall(
        b"POST /api/attend HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
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


def test_bad_bodies_are_400_json_not_500(client):
    bodies = [
        b'{"text": "the dog", "model": ["tiny-bert"]}',
        b'{"text": "the dog", "model": {"a": 1}}',
        b'{"text": "the \\ud800 dog"}',  # JSON accepts a lone surrogate; UTF-8 cannot encode it
        b"[" * 3000 + b"]" * 3000,  # deeper than json's recursion limit
        b'{"text": ' + b"1" * 4090 + b"}",  # more digits than Python converts to an int
        b"\xff\xfe not utf-8",
    ]
    for body in bodies:
        response = client.post("/api/attend", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (body[:60], response.text[:200])
        assert_json_error(response.headers, response.content)


def test_every_method_and_path_gets_a_json_answer(client):
    for method in ("PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "BREW"):
        response = client.request(method, "/api/attend", content=b"{}")
        assert response.status_code == 405 and response.headers["Allow"] == "POST", (method, response.text[:200])
        assert method in assert_json_error(response.headers, response.content)
        response = client.request(method, "/")
        assert response.status_code == 405 and set(response.headers["Allow"].split(", ")) == {"GET", "HEAD"}
        assert_json_error(response.headers, response.content)
        response = client.request(method, "/no/such/page")
        assert response.status_code == 404
        assert_json_error(response.headers, response.content)
    response = client.post("/api/models", content=b"{}")
    assert response.status_code == 405 and set(response.headers["Allow"].split(", ")) == {"GET", "HEAD"}
    for path, expected in [("/api/models", 200), ("/", 200), ("/api/attend", 405), ("/nowhere", 404)]:
        response = client.head(path)  # the GET answer's status and headers, no body
        assert response.status_code == expected and response.content == b"", (path, response.status_code)
    response = client.get("/api/models")
    assert response.headers["X-Frame-Options"] == "DENY" and response.headers["X-Content-Type-Options"] == "nosniff"


def test_server_errors_are_json_without_details(app):
    class Broken:
        kind, name = "encoder", "broken"
        model = tokenizer = None

        def example(self, text):
            raise RuntimeError("secret detail\nTraceback (most recent call last)")

    broken = ExplorerApp(explorers={"broken": Broken()}, max_chars=40)
    with TestClient(build_app(broken), raise_server_exceptions=False) as client:
        response = client.post("/api/attend", content=b'{"text": "a dog"}', headers=JSON)
    assert response.status_code == 500 and "secret" not in response.text
    assert_json_error(response.headers, response.content)


def test_stalled_clients_do_not_block_others(app):
    """16 clients that send half a request and stall, beside 8 live ones sending at once: every valid
    request is answered 200 (no connection cap turns them away), on a real uvicorn server."""
    with serving(app) as address:
        stalled = [stall(address) for _ in range(8)]
        for _ in range(4):  # part of the headers
            sock = socket.create_connection(address, timeout=HANG_GUARD_S)
            sock.sendall(b"POST /api/attend HTTP/1.1\r\nContent-Len")
            stalled.append(sock)
        stalled += [socket.create_connection(address, timeout=HANG_GUARD_S) for _ in range(4)]  # nothing at all
        results: list[tuple[int, bytes]] = []

        def live(i: int) -> None:
            body = json.dumps({"text": ["the dog runs", "a cat sleeps"][i % 2]}).encode()
            status, headers, reply = exchange(address, "POST", "/api/attend", body, JSON)
            results.append((status, reply[:200]))

        threads = [threading.Thread(target=live, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_GUARD_S)
        assert [status for status, _ in results] == [200] * 8, results
        status, headers, body = exchange(address, "GET", "/api/models")  # a stalled client blocks no route
        assert status == 200 and json.loads(body)["models"] == ["tiny-bert"]
        for sock in stalled:
            sock.close()
        assert exchange(address, "POST", "/api/attend", b'{"text": "a dog"}', JSON)[0] == 200


def test_bind_address_warning(app, capsys, caplog):
    """A non-loopback bind is warned of as a log record (which ``qkv serve`` shows), never printed."""
    models = {name: served_model(explorer) for name, explorer in app.explorers.items()}
    for host, warned in [("127.0.0.1", False), ("0.0.0.0", True)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qkv.serve.server"):
            httpd = make_server(app, models=models, host=host, port=0)
        httpd.server_close()
        logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert ("warning: serving on 0.0.0.0" in logged) is warned, logged
        assert capsys.readouterr().out == ""


def test_limits_are_checked(app, tmp_path, capsys):
    from qkv.cli import main

    missing = str(tmp_path / "missing-model")  # the options are checked before any model is opened
    for args, flag in [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--max-chars", "0"], "--max-chars"),
        (["--max-texts", "0"], "--max-texts"),
        (["--max-new-tokens", "-3"], "--max-new-tokens"),
        (["--max-batch-wait", "nan"], "--max-batch-wait"),
        (["--max-batch-wait", "-1"], "--max-batch-wait"),
        (["--max-batch-tokens", "0"], "--max-batch-tokens"),
    ]:
        assert main(["serve", "--model", missing, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("qkv serve: error:") and flag in err and "\n" not in err, err
    for limits in ({"max_texts": 0}, {"max_batch_wait_ms": -1}, {"max_body_bytes": 2.5}):
        with pytest.raises(ValueError, match=next(iter(limits))):
            Limits(**limits)


def test_missing_fastapi_is_one_line_naming_the_extra(tiny_bert_dir, monkeypatch, capsys):
    import importlib.util

    from qkv.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else find_spec(name, *a)
    )
    assert main(["serve", "--model", str(tiny_bert_dir), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv serve: error:") and "pip install 'qkv[serve]'" in err and "\n" not in err


def test_old_server_limits_are_accepted_and_ignored_with_a_warning(capsys):
    import argparse

    from qkv.cli import serve as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--timeout", "5", "--max-concurrent", "8"])
    serve_cli.warn_about_old_options(args)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("is ignored since qkv 1.1" in line for line in err)
    assert err[0].startswith("warning: --timeout") and err[1].startswith("warning: --max-concurrent")
    serve_cli.warn_about_old_options(parser.parse_args([]))
    assert capsys.readouterr().err == ""
