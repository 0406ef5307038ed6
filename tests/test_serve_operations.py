"""``qkv serve``'s operations: ``GET /metrics`` read back with prometheus_client's own parser (requests by
route and status, batch sizes, queue depths, tokens), the API key (401 without it or with another, either
header accepted, ``/health`` open, a network address refused without a key), and the access log (one
JSON object per request, with its id, a streamed answer logged once it ends)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import threading
from datetime import datetime
from pathlib import Path

import pytest
from test_serve import exchange, wait_for

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from qkv.cli import main  # noqa: E402
from qkv.serve.access import ACCESS_LOGGER, api_key_of, close_access_log, open_access_log  # noqa: E402
from qkv.serve.app import create_app  # noqa: E402
from qkv.serve.batching import DecodeKey, ModelWorker, TranslationBatcher  # noqa: E402
from qkv.serve.metrics import ServerMetrics  # noqa: E402
from qkv.serve.models import Limits, open_models  # noqa: E402
from qkv.serve.server import make_server  # noqa: E402
from qkv.viz.app import ExplorerApp  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
KEY = "k3y-for-tests_0123456789"
FIELDS = {"time", "client", "method", "path", "status", "duration_ms", "bytes", "request_id"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_operations")
    translator = shutil.copytree(FIXTURES / "translation_run", root / "en-de")
    lm = shutil.copytree(FIXTURES / "lm_run", root / "lm")
    return open_models([translator, lm])


@pytest.fixture(autouse=True)
def _access_log_reset():
    close_access_log()  # records reach caplog (the root logger) whatever an earlier test set up
    yield
    close_access_log()


def make_app(models, **options):
    explorer = ExplorerApp(explorers={name: m.explorer for name, m in models.items()}, max_chars=200)
    return create_app(models, explorer, Limits(max_chars=200), **options)


def scrape(client, **headers) -> dict[str, list]:
    """Each metric family's samples, as prometheus_client's parser reads ``/metrics``."""
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(response.text)}


def value(samples, name: str, **labels) -> float:
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, samples)
    return found[0]


def access_records(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]


def test_metrics_count_requests_batches_queues_and_tokens(models):
    with TestClient(make_app(models), raise_server_exceptions=False) as client:
        assert client.post("/v1/translate", json={"texts": ["a man rides", "two dogs"]}).status_code == 200
        assert client.post("/v1/translate", json={"texts": []}).status_code == 422  # min_length 1
        assert client.get("/no/such/page").status_code == 404
        assert client.get("/v1/models").status_code == 200
        service = client.app.state.service
        service.queued["lm"] += 3  # the gauge is read at the scrape, not kept
        try:
            families = scrape(client)
        finally:
            service.queued["lm"] -= 3
        requests = families["qkv_requests"]
        assert value(requests, "qkv_requests_total", method="POST", route="/v1/translate", status="200") == 1
        assert value(requests, "qkv_requests_total", method="POST", route="/v1/translate", status="422") == 1
        assert value(requests, "qkv_requests_total", method="GET", route="unmatched", status="404") == 1
        assert value(requests, "qkv_requests_total", method="GET", route="/v1/models", status="200") == 1
        assert not any("/no/such/page" in str(s.labels) for s in requests)  # a made-up path is no label
        latency = families["qkv_request_duration_seconds"]
        assert value(latency, "qkv_request_duration_seconds_count", route="/v1/translate") == 2
        rows = families["qkv_batch_rows"]
        assert value(rows, "qkv_batch_rows_count", kind="translate") == 1  # the 422 decoded nothing
        assert value(rows, "qkv_batch_rows_sum", kind="translate") == 2
        assert value(rows, "qkv_batch_rows_count", kind="generate") == 0
        queue = families["qkv_queue_depth"]
        assert value(queue, "qkv_queue_depth", model="lm") == 3 and value(queue, "qkv_queue_depth", model="en-de") == 0
        assert value(families["qkv_generated_tokens"], "qkv_generated_tokens_total", model="lm") == 0

        # what the generation engine calls
        service.metrics.observe_batch("generate", 5)
        service.metrics.add_tokens("lm", 7)
        service.metrics.add_tokens("lm", 4)
        service.metrics.time_to_first_token("lm", 0.2)
        families = scrape(client)
        assert value(families["qkv_generated_tokens"], "qkv_generated_tokens_total", model="lm") == 11
        first = families["qkv_time_to_first_token_seconds"]
        assert value(first, "qkv_time_to_first_token_seconds_bucket", model="lm", le="0.1") == 0
        assert value(first, "qkv_time_to_first_token_seconds_bucket", model="lm", le="0.25") == 1
        assert value(families["qkv_batch_rows"], "qkv_batch_rows_sum", kind="generate") == 5
        assert value(families["qkv_queue_depth"], "qkv_queue_depth", model="lm") == 0
        assert value(families["qkv_requests"], "qkv_requests_total", route="/metrics", status="200") == 1
    with pytest.raises(ValueError, match="batch kind"):
        service.metrics.observe_batch("embed", 1)
    with pytest.raises(ValueError, match="at least one row"):
        service.metrics.observe_batch("translate", 0)


def test_each_app_has_a_registry_of_its_own(models):
    with TestClient(make_app(models)) as first, TestClient(make_app(models)) as second:
        first.get("/v1/models")
        assert value(scrape(first)["qkv_requests"], "qkv_requests_total", route="/v1/models") == 1
        assert not [s for s in scrape(second)["qkv_requests"] if s.labels.get("route") == "/v1/models"]


def test_a_batch_of_concurrent_requests_is_one_observation():
    metrics = ServerMetrics()
    worker = ModelWorker()
    decoded: list[list[str]] = []

    def decode(texts, key):
        decoded.append(texts)
        return [text.upper() for text in texts]

    batcher = TranslationBatcher(decode, worker, max_wait_s=0.2, max_tokens=10_000, metrics=metrics)
    key = DecodeKey(1, 0.0, "gnmt")

    async def three():
        return await asyncio.gather(*(batcher.translate(texts, key, 4) for texts in (["a"], ["b", "c"], ["d"])))

    try:
        assert asyncio.run(three()) == [["A"], ["B", "C"], ["D"]]
    finally:
        worker.close()
    assert decoded == [["a", "b", "c", "d"]]
    samples = {
        (s.name, s.labels.get("kind")): s.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for s in f.samples
    }
    assert samples[("qkv_batch_rows_count", "translate")] == 1 and samples[("qkv_batch_rows_sum", "translate")] == 4


def test_the_api_key(models, caplog):
    app = make_app(models, api_key=KEY)
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER), TestClient(app, raise_server_exceptions=False) as client:
        body = {"texts": ["a man rides"]}
        for headers, message in [
            ({}, "missing API key"),
            ({"Authorization": "Bearer wrong"}, "invalid API key"),
            ({"X-API-Key": KEY[:-1]}, "invalid API key"),
            ({"Authorization": f"Basic {KEY}"}, "invalid API key"),
            ({"Authorization": f"Bearer {KEY}x"}, "invalid API key"),
        ]:
            response = client.post("/v1/translate", json=body, headers=headers)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert list(response.json()) == ["error"] and response.json()["error"].startswith(message)
            assert response.headers["x-content-type-options"] == "nosniff"
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"X-API-Key": KEY}):
            assert client.post("/v1/translate", json=body, headers=headers).status_code == 200, headers
        assert client.get("/health").status_code == 200  # readiness probes carry no key
        assert client.head("/health").status_code == 401
        assert client.get("/metrics").status_code == 401
        assert client.get("/").status_code == 401 and client.get("/no/such/page").status_code == 401
        scrape(client, **{"X-API-Key": KEY})
        for path in ("/v1/completions", "/v1/chat/completions"):  # OpenAI's error object there
            response = client.post(path, json={"model": "lm"}, headers={"Authorization": "Bearer nope"})
            assert response.status_code == 401 and response.json() == {
                "error": {
                    "message": "invalid API key",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
    records = access_records(caplog)
    assert [r["status"] for r in records[:5]] == [401] * 5 and records[5]["status"] == 200
    assert all(KEY[:8] not in json.dumps(r) for r in records) and all(
        KEY[:8] not in r.getMessage() for r in caplog.records
    )


def test_where_a_key_is_needed():
    env: dict[str, str] = {}
    assert api_key_of(None, env, host="127.0.0.1", loopback=True, waived=False) is None
    assert api_key_of(KEY, env, host="0.0.0.0", loopback=False, waived=False) == KEY
    assert api_key_of(None, {"QKV_API_KEY": KEY}, host="0.0.0.0", loopback=False, waived=False) == KEY
    assert api_key_of("flag", {"QKV_API_KEY": KEY}, host="::", loopback=False, waived=False) == "flag"
    assert api_key_of(None, {"QKV_API_KEY": KEY}, host="0.0.0.0", loopback=False, waived=True) is None
    with pytest.raises(ValueError, match=r"set QKV_API_KEY \(or pass --api-key\), or pass --no-api-key"):
        api_key_of(None, {"QKV_API_KEY": ""}, host="0.0.0.0", loopback=False, waived=False)
    with pytest.raises(ValueError, match="--api-key must be visible ASCII"):
        api_key_of("two words", env, host="127.0.0.1", loopback=True, waived=False)
    with pytest.raises(ValueError, match="contradict"):
        api_key_of(KEY, env, host="0.0.0.0", loopback=False, waived=True)


def test_qkv_serve_refuses_a_network_address_without_a_key(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "missing-model")  # the key is checked before any model is opened
    monkeypatch.delenv("QKV_API_KEY", raising=False)
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        assert main(["serve", "--model", missing, "--host", host]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("qkv serve: error:") and "\n" not in err, err
        assert "QKV_API_KEY" in err and "--api-key" in err and "--no-api-key" in err, err
    # waived, or a key given: the check passes, and the missing model is what fails
    for args in (["--no-api-key"], ["--api-key", KEY]):
        assert main(["serve", "--model", missing, "--host", "0.0.0.0", *args]) == 2
        err = capsys.readouterr().err
        assert "missing-model" in err and "QKV_API_KEY" not in err and KEY not in err, err
    monkeypatch.setenv("QKV_API_KEY", KEY)
    assert main(["serve", "--model", missing, "--host", "0.0.0.0"]) == 2
    assert "QKV_API_KEY" not in capsys.readouterr().err
    assert main(["serve", "--model", missing, "--api-key", "bad key"]) == 2
    err = capsys.readouterr().err
    assert "--api-key must be visible ASCII" in err and "bad key" not in err
    with pytest.raises(SystemExit) as exit_info:  # argparse: one or the other
        main(["serve", "--model", missing, "--access-log", "-", "--no-access-log"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_access_log_lines(models, caplog):
    secret_text = "zebras-never-logged"
    app = make_app(models)
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER), TestClient(app, raise_server_exceptions=False) as client:
        given = client.post(
            "/v1/translate?token=hidden", json={"texts": [secret_text]}, headers={"X-Request-Id": "trace-42/a"}
        )
        invalid = client.get("/v1/models", headers={"X-Request-Id": "has space"})
        too_long = client.get("/v1/models", headers={"X-Request-Id": "x" * 129})
        missing = client.get("/no/such/page")
    assert given.status_code == 200 and given.headers["x-request-id"] == "trace-42/a"
    for response in (invalid, too_long, missing):
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]), response.headers
    assert len({invalid.headers["x-request-id"], too_long.headers["x-request-id"]}) == 2
    records = access_records(caplog)
    assert [(r["method"], r["path"], r["status"]) for r in records] == [
        ("POST", "/v1/translate", 200),
        ("GET", "/v1/models", 200),
        ("GET", "/v1/models", 200),
        ("GET", "/no/such/page", 404),
    ]
    for record, response in zip(records, (given, invalid, too_long, missing)):
        assert set(record) == FIELDS
        assert record["request_id"] == response.headers["x-request-id"]
        assert record["bytes"] == len(response.content) and record["duration_ms"] >= 0
        assert record["time"].endswith("Z") and datetime.fromisoformat(record["time"]).utcoffset().total_seconds() == 0
        assert record["client"].startswith("testclient:")
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert all("\n" not in line for line in lines)
    assert not any(secret_text in line or "hidden" in line for line in lines)  # no body, no query


def test_no_access_log_and_a_log_file(models, caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER), TestClient(make_app(models, access_log=False)) as client:
        response = client.get("/v1/models", headers={"X-Request-Id": "quiet-1"})
    assert response.headers["x-request-id"] == "quiet-1" and access_records(caplog) == []
    target = tmp_path / "access.jsonl"
    open_access_log(str(target))
    try:
        with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER), TestClient(make_app(models)) as client:
            client.get("/v1/models", headers={"X-Request-Id": "to-file-1"})
            client.get("/health", headers={"X-Request-Id": "to-file-2"})
        assert access_records(caplog) == []  # to the file only, not to stderr as well
    finally:
        close_access_log()
    lines = target.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["to-file-1", "to-file-2"]
    assert logging.getLogger(ACCESS_LOGGER).propagate
    with pytest.raises(ValueError, match="--access-log"):
        open_access_log(str(tmp_path / "no-such-folder" / "access.jsonl"))


def test_a_live_server_with_a_key_logs_a_stream_when_it_ends(models, caplog):
    httpd = make_server(
        ExplorerApp(explorers={name: m.explorer for name, m in models.items()}, max_chars=200),
        models=models,
        host="127.0.0.1",
        port=0,
        api_key=KEY,
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        thread.start()
        try:
            wait_for(lambda: httpd.uvicorn.started, "the server to start")
            body = json.dumps({"prompt": "First Citizen:\n", "max_tokens": 12, "seed": 1}).encode()
            json_type = {"Content-Type": "application/json"}
            assert exchange(httpd.server_address, "POST", "/v1/generate", body, json_type)[0] == 401
            status, headers, streamed = exchange(
                httpd.server_address,
                "POST",
                "/v1/generate",
                body,
                {**json_type, "Authorization": f"Bearer {KEY}", "X-Request-Id": "stream-1"},
            )
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            assert headers["x-request-id"] == "stream-1" and b"event: done" in streamed
            assert exchange(httpd.server_address, "GET", "/health")[0] == 200
        finally:
            httpd.shutdown()
            httpd.server_close()
    records = access_records(caplog)
    assert [(r["path"], r["status"]) for r in records] == [
        ("/v1/generate", 401),
        ("/v1/generate", 200),
        ("/health", 200),
    ]
    stream = records[1]
    assert (
        stream["request_id"] == "stream-1"
        and stream["bytes"] == len(streamed)
        and stream["client"].startswith("127.0.0.1:")
    )
