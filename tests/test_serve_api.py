"""``qkv serve``'s API: /v1/translate (dynamically batched, each request's translations equal to
decoding it alone with qkv.decoding.translate.translate_texts), /v1/generate (server-sent events equal
to CausalLM.generate with the same seed, greedy included), /v1/embed (against Hugging Face's BertModel
mean-pooled), the OpenAPI docs, and every error as one line of JSON with its status."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from test_serve import make_tiny_bert

from qkv.cli import main
from qkv.data.dates import generate_dates
from qkv.decoding.translate import translate_texts
from qkv.serve.app import create_app
from qkv.serve.batching import DecodeKey, ModelWorker
from qkv.serve.generation import Generations
from qkv.serve.models import Limits, ServedModel, open_models
from qkv.serve.schemas import GenerateRequest
from qkv.serve.service import sampling_of
from qkv.serve.streaming import Sampling, generate_text, stream_events
from qkv.viz.app import ExplorerApp

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
SENTENCES = generate_dates(8, seed=3, split="test").src
# a dates run trained 120 steps: varied, partly right translations (as tests/test_export_ct2.py trains)
TRAIN = ["train", "--data", "dates", "--max-steps", "120", "--minutes", "0", "--eval-every-steps", "0"]
TRAIN += ["--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--d-ff", "64"]
TRAIN += ["--max-tokens", "800", "--no-progress", "--threads", "1"]
PROMPT = "First Citizen:\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_api")
    translator = root / "en-de"
    assert main([*TRAIN, "--run-dir", str(translator)]) == 0
    torch.set_num_threads(1)  # the CLI call set all cores (see conftest)
    lm = shutil.copytree(FIXTURES / "lm_run", root / "lm")
    bert = make_tiny_bert(root / "tiny-bert")
    torch.manual_seed(0)
    return open_models([translator, lm, bert])


def make_client(models, **limits) -> TestClient:
    explorer = ExplorerApp(explorers={name: m.explorer for name, m in models.items()}, max_chars=200)
    return TestClient(create_app(models, explorer, Limits(max_chars=200, **limits)), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(models):
    with make_client(models, max_texts=8, max_new_tokens=64, max_body_bytes=20_000) as client:
        yield client


def test_models_by_kind_health_and_docs(client):
    listing = client.get("/v1/models").json()["models"]
    assert [(m["name"], m["kind"], m["endpoint"]) for m in listing] == [
        ("en-de", "translation", "/v1/translate"),
        ("lm", "language model", "/v1/generate"),
        ("tiny-bert", "encoder", "/v1/embed"),
    ]
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/api/models").json() == {"models": ["en-de", "lm", "tiny-bert"], "max_chars": 200}
    docs = client.get("/docs")
    # a page of its own: no script, nothing loaded from anywhere (Swagger UI came from a CDN)
    assert docs.status_code == 200 and "/v1/translate" in docs.text and 'href="/openapi.json"' in docs.text
    assert "<script" not in docs.text.lower() and "http" not in docs.text.replace("href=", "")
    assert "default-src 'none'" in docs.headers["content-security-policy"]
    assert client.get("/redoc").status_code == 404
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/translate", "/v1/generate", "/v1/embed", "/health"} <= set(paths)


@pytest.mark.parametrize(("beam", "alpha", "penalty"), [(1, 0.6, "gnmt"), (3, 0.6, "gnmt"), (3, 1.5, "power")])
def test_translate_equals_translate_texts(client, models, beam, alpha, penalty):
    served = models["en-de"]
    body = {"texts": SENTENCES, "beam_size": beam, "alpha": alpha, "penalty": penalty}
    answer = client.post("/v1/translate", json=body).json()
    expected = translate_texts(served.model, served.tokenizer, SENTENCES, beam_size=beam, alpha=alpha, penalty=penalty)
    assert answer["translations"] == expected and len(set(expected)) > 1
    assert (answer["beam_size"], answer["alpha"], answer["penalty"]) == (beam, alpha, penalty)


def test_translate_defaults_to_the_runs_recipe(client):
    answer = client.post("/v1/translate", json={"texts": SENTENCES[:1]}).json()
    assert (answer["model"], answer["beam_size"], answer["alpha"]) == ("en-de", 5, 0.6)  # the dates recipe's


async def gather(jobs: list) -> list:
    return await asyncio.gather(*jobs)


def test_concurrent_requests_share_batches_and_decode_as_alone(models):
    """Requests queued together decode as one batch per decoding setting; each request gets what
    decoding it alone gives."""
    served = models["en-de"]
    greedy, beam = DecodeKey(1, 0.6, "gnmt"), DecodeKey(3, 1.0, "power")
    requests = [([s], greedy) for s in SENTENCES] + [(SENTENCES[:3], beam), (SENTENCES[3:], beam)]
    with make_client(models, max_batch_wait_ms=50) as client:
        batcher = client.app.state.service.batchers["en-de"]

        results = client.portal.call(gather, [batcher.translate(t, key, 10 * len(t)) for t, key in requests])
    assert batcher.batches == 2  # one per decoding setting
    for (texts, key), got in zip(requests, results):
        alone = translate_texts(
            served.model, served.tokenizer, texts, beam_size=key.beam_size, alpha=key.alpha, penalty=key.penalty
        )
        assert got == alone
    with make_client(models, max_batch_wait_ms=50, max_batch_tokens=30) as client:  # a budget of 3 requests
        batcher = client.app.state.service.batchers["en-de"]
        client.portal.call(gather, [batcher.translate([s], greedy, 10) for s in SENTENCES])
        assert batcher.batches == 3  # 8 requests of 10 tokens: 3 + 3 + 2
    with make_client(models, max_batch_wait_ms=0) as client:  # batching off: each request alone
        batcher = client.app.state.service.batchers["en-de"]
        client.portal.call(gather, [batcher.translate([s], greedy, 10) for s in SENTENCES])
        assert batcher.batches == len(SENTENCES)


def test_concurrent_http_requests_get_their_own_translations(models):
    served = models["en-de"]
    expected = translate_texts(served.model, served.tokenizer, SENTENCES, beam_size=2, alpha=0.6)
    got: dict[int, list[str]] = {}
    with make_client(models, max_batch_wait_ms=20) as client:

        def send(i: int) -> None:
            body = {"texts": [SENTENCES[i]], "beam_size": 2, "alpha": 0.6}
            got[i] = client.post("/v1/translate", json=body).json()["translations"]

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(SENTENCES))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert [got[i][0] for i in range(len(SENTENCES))] == expected


def read_events(client, body: dict) -> list[tuple[str, dict]]:
    events = []
    with client.stream("POST", "/v1/generate", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        name = "message"
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
                name = "message"
    return events


def reference_continuation(served, n: int, **sampling) -> str:
    """CausalLM.generate itself, the prompt's tokens cut off."""
    ids = served.tokenizer.encode(PROMPT)
    out = served.model.generate(torch.tensor([ids]), n, **sampling)
    return served.tokenizer.decode(out[0, len(ids) :].tolist())


def test_generate_stream_equals_greedy_generation(client, models):
    expected = reference_continuation(models["lm"], 40, temperature=0)
    events = read_events(client, {"prompt": PROMPT, "max_tokens": 40, "temperature": 0})
    pieces = [data["text"] for name, data in events if name == "message"]
    assert len(pieces) > 1 and "".join(pieces) == expected
    assert events[-1] == ("done", {"text": expected, "tokens": 40, "finish_reason": "length"})
    stop = expected[10:12]
    cut = expected[: expected.find(stop)]
    events = read_events(client, {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": [stop]})
    assert "".join(d["text"] for n, d in events if n == "message") == cut
    assert events[-1][1]["text"] == cut and events[-1][1]["finish_reason"] == "stop"


def test_generate_with_a_seed_equals_sampling_with_that_seed(client, models):
    sampling = {"temperature": 0.9, "top_k": 8, "top_p": 0.95}
    expected = reference_continuation(models["lm"], 30, generator=torch.Generator().manual_seed(7), **sampling)
    body = {"prompt": PROMPT, "max_tokens": 30, "seed": 7, **sampling}
    streamed = "".join(d["text"] for n, d in read_events(client, body) if n == "message")
    whole = client.post("/v1/generate", json={**body, "stream": False}).json()
    assert streamed == whole["text"] == expected and whole["tokens"] == 30


def test_concurrent_generations_share_steps_and_each_gives_its_text_alone(models):
    """Generation requests sent together decode in one continuous batch (fewer steps than tokens);
    each seeded request's text is what CausalLM.generate gives with that seed alone, with all six
    decoding together or (a batch of 1) one at a time."""
    served = models["lm"]
    sampling = {"temperature": 0.9, "top_k": 8}
    lengths = [12, 30, 5, 21, 17, 9]
    bodies = [
        {"prompt": PROMPT, "max_tokens": n, "seed": 40 + i, "stream": False, **sampling} for i, n in enumerate(lengths)
    ]

    async def ask(client_app, body) -> str:
        service = client_app.state.service
        request = sampling_of(service, served, GenerateRequest(**body))
        return (await generate_text(service.generations, served, request))["text"]

    for rows in (32, 1):
        with make_client(models, max_new_tokens=64, max_generate_batch=rows) as client:
            texts = client.portal.call(gather, [ask(client.app, body) for body in bodies])
            generations = client.app.state.service.generations
        for i, n in enumerate(lengths):
            generator = torch.Generator().manual_seed(40 + i)
            assert texts[i] == reference_continuation(served, n, generator=generator, **sampling), f"request {i}"
        assert generations.steps < sum(lengths)  # a step decodes several requests, or one and a joiner
        assert generations.widest == (len(lengths) if rows == 32 else 1)


def test_a_client_that_leaves_stops_the_sampling(models):
    served = models["lm"]

    class Counting:  # the run's tokenizer, counting the steps (each step decodes once)
        calls = 0

        def decode(self, ids):
            Counting.calls += 1
            return served.tokenizer.decode(ids)

    worker = ModelWorker()
    generations = Generations(worker)
    counted = ServedModel("counted", served.explorer)
    counted.explorer = type("E", (), {"model": served.model, "tokenizer": Counting(), "kind": "lm"})()
    request = Sampling(ids=served.tokenizer.encode(PROMPT), max_tokens=5000, temperature=0)

    async def leave_after_the_first_event() -> None:
        events = stream_events(generations, counted, request)
        assert (await events.__anext__()).startswith("data: ")
        await events.aclose()  # what Starlette does when the client disconnects
        for _ in range(3):  # the member leaves at its next step; then the batch stops stepping
            await worker.run(lambda: None)
        assert generations.report() == {"counted": 0}

    try:
        asyncio.run(leave_after_the_first_event())
    finally:
        worker.close()
    assert 1 <= Counting.calls < 5000


def test_embed_equals_hugging_face_mean_pooling(client, models, tmp_path):
    transformers = pytest.importorskip("transformers")
    texts = ["the dog runs", "a cat sleeps on the mat", "time flies like an arrow"]
    answer = client.post("/v1/embed", json={"texts": texts}).json()
    assert answer["model"] == "tiny-bert" and answer["dimension"] == 32 and answer["normalized"]
    source = make_tiny_bert(tmp_path / "tiny-bert")  # the same seed and config: the same weights
    hf = transformers.BertModel.from_pretrained(str(source)).eval()
    tokenizer = transformers.BertTokenizer(str(source / "vocab.txt"))
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert torch.allclose(torch.tensor(answer["embeddings"]), expected, atol=1e-5)
    raw = client.post("/v1/embed", json={"texts": texts, "normalize": False}).json()["embeddings"]
    assert torch.allclose(torch.tensor(raw), (hidden * mask).sum(1) / mask.sum(1), atol=1e-5)


def error(response, status: int) -> str:
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json")
    message = response.json()["error"]
    assert isinstance(message, str) and message and "\n" not in message and "Traceback" not in message
    return message


def test_errors_are_one_line_of_json(client):
    post = client.post
    assert "not valid JSON" in error(post("/v1/translate", content=b'{"texts": [', headers=JSON), 400)
    assert "texts" in error(post("/v1/translate", json={"texts": "one string"}), 422)
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl -d without -H
    assert "Content-Type: application/json" in error(
        post("/v1/translate", content=b'{"texts": ["a"]}', headers=form), 415
    )
    assert "beam_size" in error(post("/v1/translate", json={"texts": ["a"], "beam_size": "4"}), 422)
    assert "penalty" in error(post("/v1/translate", json={"texts": ["a"], "penalty": "cubic"}), 422)
    assert "extra" in error(post("/v1/translate", json={"texts": ["a"], "colour": 1}), 422).lower()
    assert "non-empty" in error(post("/v1/translate", json={"texts": ["  "]}), 422)
    assert "surrogate" in error(post("/v1/translate", content=b'{"texts": ["a \\ud800"]}', headers=JSON), 422)
    assert "unknown model 'nope'" in error(post("/v1/translate", json={"texts": ["a"], "model": "nope"}), 404)
    assert "/v1/generate" in error(post("/v1/translate", json={"texts": ["a"], "model": "lm"}), 400)
    assert "limit is 8" in error(post("/v1/translate", json={"texts": ["a"] * 9}), 413)
    assert "limit is 200" in error(post("/v1/translate", json={"texts": ["a" * 201]}), 413)
    assert "reads at most 63" in error(post("/v1/translate", json={"texts": ["a b " * 45]}), 413)
    assert "limit is 16" in error(post("/v1/translate", json={"texts": ["a"], "beam_size": 17}), 413)
    assert "limit is 20000" in error(post("/v1/embed", json={"texts": ["word " * 39] * 200}), 413)
    assert "limit is 64" in error(post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 65}), 413)
    assert "top_p" in error(post("/v1/generate", json={"prompt": PROMPT, "top_p": 1.5}), 422)
    assert "prompt" in error(post("/v1/generate", json={"prompt": "\u4e2d\u6587"}), 422)  # not in the vocabulary
    assert "GET is not allowed" in error(client.get("/v1/translate"), 405)
    assert "no such page" in error(client.get("/v2/translate"), 404)


def test_a_server_without_a_kind_says_so(models):
    only_bert = {"tiny-bert": models["tiny-bert"]}
    with make_client(only_bert) as client:
        assert "no translation model" in error(client.post("/v1/translate", json={"texts": ["a"]}), 404)
        assert "no language model" in error(client.post("/v1/generate", json={"prompt": "a"}), 404)


JSON = {"Content-Type": "application/json"}
