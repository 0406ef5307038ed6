"""``qkv serve``: request validation, HTTP status codes, and the command bound to 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

import qkv
from qkv.viz.explorers import EncoderExplorer
from qkv.viz.server import MAX_BODY_BYTES, ExplorerApp, RequestError, make_server

WORDS = "the a dog cat runs sleeps on mat beach time flies like an arrow".split()


def make_tiny_bert(folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    config = transformers.BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=24,
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
    status, ctype, body = request(address, "POST", "/api/attend", json.dumps(payload).encode(),
                                  {"Content-Type": "application/json"})
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
    cmd = [sys.executable, "-c", "import sys; from qkv.cli import main; sys.exit(main())",
           "serve", "--model", str(tiny_bert_dir), "--port", "0", "--text", "a cat"]
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
    cmd = [sys.executable, "-c", "import sys; from qkv.cli import main; sys.exit(main())",
           "serve", "--model", str(tmp_path / "missing"), "--port", "0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("qkv serve: error:") and "\n" not in result.stderr.strip()
