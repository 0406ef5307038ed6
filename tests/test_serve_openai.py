"""``qkv serve``'s OpenAI-compatible API, through the official ``openai`` client against a live server:
/v1/models, /v1/completions (greedy equal to CausalLM.generate, a seed equal to /v1/generate's,
streamed equal to whole, stop texts, log-probabilities against the model's own log_softmax, token
counts), /v1/chat/completions on a tiny Llama folder with a chat template (its prompt tokenized as
transformers' apply_chat_template tokenizes it), and errors in OpenAI's shape (the server's
refusals before the routes, 415 / 413 / 421, and a fault's 500, included); chat templates
rendered as transformers renders them, in jinja2's sandbox."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_serve import HANG_GUARD_S, make_tiny_bert, wait_for

from qkv.serve.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from qkv.serve.models import Limits, open_models
from qkv.serve.server import make_server
from qkv.viz.app import ExplorerApp

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
PROMPT = "First Citizen:\n"
# a template using what transformers gives templates: the special tokens, raise_exception, tojson
# (not HTML-escaped), loop controls, a namespace, trimmed blocks
TEMPLATE = """{% if messages[0]['role'] == 'system' and messages | length == 1 %}
{{ raise_exception('a system message alone: add a user message') }}
{% endif %}
{% set ns = namespace(turns=0) %}
{{ bos_token }}
{% for message in messages %}
{% if loop.index > 20 %}{% break %}{% endif %}
{% set ns.turns = ns.turns + 1 %}
<|{{ message['role'] }}|>{% if message.name %} {{ message.name | tojson }}{% endif %}

{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<|assistant|> {{ ns.turns }}
{% endif %}"""
CHAT = [
    {"role": "system", "content": "You are terse & kind <b>."},
    {"role": "user", "content": "Who was the first citizen? ça va ", "name": "José <j>"},
]
LLAMA = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
LLAMA |= dict(num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=None)


def chat_tokenizer(template: str) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of 300 tokens with ``<s>`` put before a text (as Llama's), and ``template``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = (FIXTURES / "lm_run" / "tokenizer.json").read_text() + " ".join(m["content"] for m in CHAT)
    tok.train_from_iterator([text] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = template
    return fast


def make_chat_folder(folder: Path) -> Path:
    """A random tiny Llama and its tokenizer with :data:`TEMPLATE`, saved as transformers saves them."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    with torch.no_grad():  # off the initial norms, so that greedy continuations vary
        for param in model.parameters():
            param.add_(torch.randn(param.shape) * 0.3)
    model.save_pretrained(folder)
    chat_tokenizer(TEMPLATE).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live server of a character LM run, a tiny Llama with a chat template and a tiny BERT;
    yields its models, its address and an ``openai`` client of it."""
    root = tmp_path_factory.mktemp("serve_openai")
    folders = [shutil.copytree(FIXTURES / "lm_run", root / "lm"), make_chat_folder(root / "tiny-chat")]
    opened = open_models([*folders, make_tiny_bert(root / "tiny-bert")])
    explorer = ExplorerApp(explorers={name: m.explorer for name, m in opened.items()}, max_chars=200)
    limits = Limits(max_chars=200, max_new_tokens=64)
    httpd = make_server(explorer, models=opened, host="127.0.0.1", port=0, limits=limits)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    wait_for(lambda: httpd.uvicorn.started, "the server to start")
    host, port = httpd.server_address[:2]
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
    try:
        yield opened, (host, port), client
    finally:
        httpd.shutdown()
        httpd.server_close()


def post(address, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*address, timeout=HANG_GUARD_S)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def continuation(model, tokenizer, ids: list[int], n: int, **sampling) -> str:
    """CausalLM.generate itself, the prompt's tokens cut off."""
    out = model.generate(torch.tensor([ids]), n, **sampling)
    return tokenizer.decode(out[0, len(ids) :].tolist())


def test_models_in_openais_shape(served):
    _, address, client = served
    listing = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in listing] == [
        (n, "model", "qkv") for n in ("lm", "tiny-chat", "tiny-bert")
    ]
    assert all(isinstance(m.created, int) and m.created > 1_600_000_000 for m in listing)
    assert (listing[0].kind, listing[0].endpoint) == ("language model", "/v1/generate")  # qkv's own fields
    assert client.models.retrieve("tiny-bert").endpoint == "/v1/embed"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.code == "model_not_found" and "'gpt-4' does not exist" in caught.value.message


def test_completion_greedy_equals_generate_with_token_counts(served):
    models_, _, client = served
    lm = models_["lm"]
    ids = lm.tokenizer.encode(PROMPT)
    expected = continuation(lm.model, lm.tokenizer, ids, 40, temperature=0)
    answer = client.completions.create(model="lm", prompt=PROMPT, max_tokens=40, temperature=0)
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-") and answer.model == "lm"
    (choice,) = answer.choices
    assert (choice.text, choice.index, choice.finish_reason, choice.logprobs) == (expected, 0, "length", None)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        len(ids),
        40,
        len(ids) + 40,
    )
    default = client.completions.create(model="lm", prompt=[PROMPT], temperature=0)  # a list of one prompt
    assert default.usage.completion_tokens == 16 and default.choices[0].text == expected[:16]  # OpenAI's default


def test_seeded_streamed_equals_whole_and_v1_generate(served):
    _, address, client = served
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 30}
    status, generated = post(address, "/v1/generate", {"prompt": PROMPT, "stream": False, **sampling})
    assert status == 200
    whole = client.completions.create(model="lm", prompt=PROMPT, **sampling)
    chunks = list(
        client.completions.create(
            model="lm", prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **sampling
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert whole.choices[0].text == "".join(texts) == generated["text"] and len(texts) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None] * (len(texts) - 1) + ["length"]
    assert len({c.id for c in chunks}) == 1 and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 30 == whole.usage.completion_tokens


def test_stop_texts_cut_the_completion(served):
    _, _, client = served
    expected = client.completions.create(model="lm", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = expected[10:12]
    cut = expected[: expected.find(stop)]
    for form in (stop, [stop, "never here"]):
        choice = client.completions.create(model="lm", prompt=PROMPT, max_tokens=40, temperature=0, stop=form).choices[
            0
        ]
        assert (choice.text, choice.finish_reason) == (cut, "stop")
    streamed = client.completions.create(
        model="lm", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_logprobs_are_the_models_own(served):
    models_, _, client = served
    lm = models_["lm"]
    answer = client.completions.create(model="lm", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    scores = answer.choices[0].logprobs
    assert "".join(scores.tokens) == answer.choices[0].text and len(scores.tokens) == 12
    assert scores.text_offset == [len("".join(scores.tokens[:i])) for i in range(12)] and scores.top_logprobs is None
    ids = lm.tokenizer.encode(PROMPT) + lm.tokenizer.encode(answer.choices[0].text)
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits[0].float()
    start = len(ids) - 12
    expected = torch.log_softmax(logits[start - 1 : -1], dim=-1).gather(1, torch.tensor(ids[start:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(scores.token_logprobs), expected, atol=1e-4)


def test_errors_in_openais_shape(served):
    _, address, client = served
    refused = [
        (dict(model="lm", prompt=PROMPT, n=2), "n=1", "n"),
        (dict(model="lm", prompt=[PROMPT, PROMPT]), "2 prompts", "prompt"),
        (dict(model="lm", prompt=PROMPT, echo=True), "echo", "echo"),
        (dict(model="lm", prompt=PROMPT, temperature=500), "temperature", "temperature"),
        (dict(model="lm", prompt=PROMPT, max_tokens=65), "the limit is 64", "max_tokens"),
        (dict(model="lm", prompt="Kxz"), "prompt", "prompt"),  # K is not in the run's characters
        (dict(model="lm", prompt=PROMPT, extra_body={"best_of": "x"}), "best_of", "best_of"),  # a 422 as a 400
        (dict(model="lm", prompt=PROMPT, extra_body={"tools": []}), "Extra inputs", "tools"),
        (dict(model="tiny-bert", prompt=PROMPT), "encoder", None),
    ]
    for body, words, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**body)
        error = caught.value.body
        assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error", body
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT)
    assert missing.value.code == "model_not_found" and missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        client.chat.completions.create(model="lm", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="a system message alone"):  # the template's raise_exception
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "system", "content": "Hi"}])
    status, answer = post(address, "/v1/generate", {"prompt": PROMPT, "n": 2})  # the other routes keep their shape
    assert status == 422 and isinstance(answer["error"], str)


OPENAI_ROUTES = [("completions", {"model": "lm", "prompt": PROMPT}), ("chat.completions", {"model": "tiny-chat"})]


def create(client, route: str, body: dict):
    """``client.completions.create`` or ``client.chat.completions.create`` (a chat with one message)."""
    if route == "completions":
        return client.completions.create(**body, max_tokens=4)
    return client.chat.completions.create(**body, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)


def openai_shaped(caught, status: int, words: str, kind: str = "invalid_request_error") -> None:
    """The official client read an error in OpenAI's shape: its status, message and type."""
    error = caught.value
    assert error.status_code == status and isinstance(error.body, dict), error.body
    assert set(error.body) == {"message", "type", "param", "code"} and words in error.body["message"], error.body
    assert (error.type, error.param, error.code) == (kind, None, None)


def raw_post(address, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*address, timeout=HANG_GUARD_S)
    try:
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_not_sent_as_json_is_415_in_openais_shape(served, path):
    _, address, _ = served
    body = json.dumps({"model": "lm", "prompt": PROMPT}).encode()
    for headers in ({}, {"Content-Type": "text/plain"}):
        status, answer = raw_post(address, path, body, headers)
        assert status == 415 and set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert "Content-Type: application/json" in answer["error"]["message"]
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] is None
    status, answer = raw_post(address, "/v1/generate", body, {"Content-Type": "text/plain"})
    assert status == 415 and isinstance(answer["error"], str)  # qkv's own routes keep their shape


@pytest.mark.parametrize(("route", "body"), OPENAI_ROUTES)
def test_a_body_over_the_limit_is_413_in_openais_shape(served, route, body):
    _, _, client = served
    with pytest.raises(openai.APIStatusError) as caught:  # over Limits().max_body_bytes (256 KiB)
        create(client, route, {**body, "user": "x" * 300_000})
    openai_shaped(caught, 413, "the limit is 262144")


@pytest.mark.parametrize(("route", "body"), OPENAI_ROUTES)
def test_a_host_not_of_the_server_is_421_in_openais_shape(served, route, body):
    _, _, client = served
    with pytest.raises(openai.APIStatusError) as caught:
        create(client.with_options(default_headers={"Host": "evil.example"}), route, body)
    openai_shaped(caught, 421, "--allow-host evil.example")


@pytest.mark.parametrize(("route", "body"), OPENAI_ROUTES)
def test_a_fault_is_500_in_openais_shape(served, monkeypatch, caplog, route, body):
    models_, _, client = served

    def broken(*args, **kwargs):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(models_[body["model"]].tokenizer, "encode", broken)
    with caplog.at_level(logging.ERROR), pytest.raises(openai.InternalServerError) as caught:
        create(client, route, body)
    openai_shaped(caught, 500, "internal error; see the server log", kind="server_error")
    assert "secret" not in caught.value.message and any(r.exc_info for r in caplog.records)


def test_chat_prompt_is_transformers_and_the_answer_greedy(served, tmp_path):
    models_, _, client = served
    chat = models_["tiny-chat"]
    reference = transformers.AutoTokenizer.from_pretrained(chat.folder)
    ids = reference.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert ids.count(0) == 1  # one BOS: the template's, none added by the tokenizer
    expected = continuation(chat.model, chat.tokenizer, ids, 48, temperature=0)
    content, reason = (expected.split("</s>")[0], "stop") if "</s>" in expected else (expected, "length")
    answer = client.chat.completions.create(model="tiny-chat", messages=CHAT, temperature=0, max_completion_tokens=48)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    (choice,) = answer.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", content, reason)
    assert answer.usage.prompt_tokens == len(ids) and len(set(content)) > 3
    chunks = list(
        client.chat.completions.create(model="tiny-chat", messages=CHAT, temperature=0, max_tokens=48, stream=True)
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason == reason
    scored = client.chat.completions.create(
        model="tiny-chat", messages=CHAT, temperature=0, max_tokens=5, logprobs=True
    )
    assert "".join(t.token for t in scored.choices[0].logprobs.content) == scored.choices[0].message.content


@pytest.mark.parametrize("form", ["chat_template.jinja", "tokenizer_config.json"])
def test_templates_render_as_transformers_renders_them(tmp_path, form):
    chat_tokenizer(TEMPLATE).save_pretrained(tmp_path)
    if form == "tokenizer_config.json":  # the older place of the template
        config = json.loads((tmp_path / form).read_text())
        (tmp_path / form).write_text(json.dumps({**config, "chat_template": TEMPLATE}))
        (tmp_path / "chat_template.jinja").unlink()
    template = load_chat_template(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for messages in (CHAT, CHAT[1:], [*CHAT, {"role": "assistant", "content": "A man."}, CHAT[1]] * 8):
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert template is not None and template.render(messages) == expected
    assert '"José <j>"' in expected  # tojson as transformers writes it: neither HTML- nor ASCII-escaped
    with pytest.raises(ChatTemplateError, match="a system message alone"):
        template.render(CHAT[:1])
    assert load_chat_template(FIXTURES / "lm_run") is None


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox: no attribute starting with _
        "{{ messages.append({'role': 'user'}) }}",  # immutable: what the template is given stays as it is
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_a_template_runs_in_the_sandbox(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(CHAT)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10^10 empty turns


@pytest.mark.parametrize(
    "source, reason",
    [
        (LOOPS, "ran past 0.2 s"),  # no call, no output: only the line deadline sees it
        ("{% for m in messages %}" + LOOPS + "{% endfor %}", "ran past 0.2 s"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses too deeply"),
        ("{% for i in range(100000) %}{{ messages[0]['content'] * 100 }}{% endfor %}", "writes more than 1000000"),
        ("{{ 'x' * 10**9 }}", "a repeat of 1 items 1000000000 times"),
        ("{% set n = 10**9 %}{{ [0] * n }}", "a repeat of 1 items"),
        ("{{ 7 ** 100000000 }}", "the power 7 ** 100000000 is over 100000 bits"),
        (
            "{% set ns = namespace(x=1) %}{% set ns.x = 2**50000 %}{% set ns.x = ns.x * ns.x %}",
            "a product is over 100000 bits",
        ),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "made"),
        ("{{ 'x' | center(10**9) }}", "the number 1000000000 is over its limit"),
        ("{{ 'x'.ljust(10**9) }}", "the number 1000000000 is over its limit"),
        ("{{ '{:>2000000}'.format('x') }}", "an operation made 2000000 items"),
        ("{{ range(10**7) | list }}", "over its limit"),
    ],
)
def test_a_template_is_stopped_at_its_limits(source, reason):
    """The sandbox does not bound work: each of these would hold a worker for minutes or take
    gigabytes. Each is refused with its reason (the deadline short for the loops, long for the others,
    so that each of those is stopped by its own limit), and the thread's trace function is put back."""
    before = sys.gettrace()
    with pytest.raises(ChatTemplateError, match=re.escape(reason)):
        ChatTemplate(source, max_seconds=0.2 if "ran past" in reason else 60).render(CHAT)
    assert sys.gettrace() is before
    within = ChatTemplate(
        "{% for i in range(2000) %}{{ 'ab' * 3 + '%s' % i }}{% endfor %}{{ 2 ** 10 }}", max_seconds=60
    )
    assert (
        within.render(CHAT) == "".join(f"ababab{i}" for i in range(2000)) + "1024"
    )  # the same operations inside the limits


def test_a_chat_template_renders_off_the_event_loop(served, monkeypatch):
    """A template is rendered in a worker thread: however long it takes, the server's loop goes on."""
    seen = []
    render = ChatTemplate.render

    def recording(self, messages):
        try:
            asyncio.get_running_loop()
            seen.append("on the event loop")
        except RuntimeError:
            seen.append("off the loop")
        return render(self, messages)

    monkeypatch.setattr(ChatTemplate, "render", recording)
    _, _, client = served
    client.chat.completions.create(model="tiny-chat", messages=CHAT, temperature=0, max_tokens=2)
    assert seen == ["off the loop"]
