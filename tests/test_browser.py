"""The explorer in a real browser: Debian's headless Chromium driven by Playwright (no browser
download), with networking disabled for the static page and only 127.0.0.1 allowed for ``qkv serve``.

Set ``QKV_SCREENSHOT=docs/explorer.png`` to also save the README's screenshot of the static page.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from chromium import chromium, playwright_or_skip

import qkv
from qkv import Transformer, TransformerConfig
from qkv.cli import main
from qkv.serve.server import make_server
from qkv.viz import EncoderExplorer, Seq2SeqExplorer, explorer_data, write_html
from qkv.viz.app import ExplorerApp

playwright_or_skip(module=True)


class WordTokenizer:
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, words):
        self.words = ["<pad>", "<s>", "</s>", "<unk>", *words]
        self.index = {w: i for i, w in enumerate(self.words)}

    def encode(self, text, *, add_bos=False, add_eos=False):
        ids = [self.index.get(w, 3) for w in text.split()]
        return ([1] if add_bos else []) + ids + ([2] if add_eos else [])

    def decode(self, ids):
        return " ".join(self.words[int(i)] for i in ids if int(i) > 3)


@pytest.fixture(scope="module")
def browser():
    with chromium() as instance:
        yield instance


@pytest.fixture(scope="module", name="minilm")  # named apart from the function: other modules import it
def minilm_fixture():
    from qkv.pretrained import default_model_path

    try:
        return qkv.load_pretrained(default_model_path(), device="cpu")
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module", name="seq2seq_explorer")
def seq2seq_explorer_fixture():
    torch.manual_seed(3)
    config = TransformerConfig(
        src_vocab_size=15,
        tgt_vocab_size=15,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        max_len=32,
        dropout=0.0,
    )
    tokenizer = WordTokenizer(["a", "dog", "runs", "on", "the", "beach", "ein", "hund", "läuft", "am", "strand"])
    return Seq2SeqExplorer(
        model=Transformer(config).eval(), tokenizer=tokenizer, name="tiny-translator", max_new_tokens=6
    )


class Watch:
    """Console errors, page errors and every request a page makes."""

    def __init__(self, page):
        self.errors, self.requests = [], []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("request", lambda r: self.requests.append(r.url))


def lines(page) -> list[str]:
    """What the head view draws: one 'head:query:key:opacity' entry per line."""
    return page.eval_on_selector_all(
        "#head-svg line",
        "ls => ls.map(l => [l.dataset.head, l.dataset.q, l.dataset.k, l.getAttribute('stroke-opacity')].join(':'))",
    )


def texts(page, side: str) -> list[str]:
    return page.eval_on_selector_all(f"#head-svg text.{side}", "ts => ts.map(t => t.textContent)")


def wait_renders(page, more_than: int) -> int:
    page.wait_for_function("n => Number(document.body.dataset.renders || 0) > n", arg=more_than)
    return int(page.evaluate("Number(document.body.dataset.renders)"))


def offline_page(browser, blocked: list):
    context = browser.new_context(viewport={"width": 1320, "height": 900})
    context.set_offline(True)

    def only_files(route):
        if route.request.url.startswith(("file:", "data:")):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", only_files)
    return context, context.new_page()


def test_static_explorer_from_qkv_attend(browser, minilm, tmp_path):
    html = tmp_path / "attention.html"
    assert main(["attend", "time flies like an arrow", "fruit flies like a banana", "-o", str(html)]) == 0
    blocked: list[str] = []
    context, page = offline_page(browser, blocked)
    watch = Watch(page)
    page.goto(html.as_uri())
    renders = wait_renders(page, 0)
    assert texts(page, "query") == ["[CLS]", "time", "flies", "like", "an", "arrow", "[SEP]"]
    layer0 = lines(page)
    assert layer0 and page.locator("#model-grid canvas").count() == 6 * 12
    screenshot = os.environ.get("QKV_SCREENSHOT")
    if screenshot:
        page.select_option("#layer-select", "2")
        page.hover("#head-svg text.query[data-index='2']")  # focus "flies"
        page.screenshot(path=screenshot, full_page=True)
        page.mouse.move(1200, 10)
        page.select_option("#layer-select", "0")
        renders = wait_renders(page, renders + 1)

    # another layer draws different lines
    page.select_option("#layer-select", "3")
    renders = wait_renders(page, renders)
    layer3 = lines(page)
    assert layer3 and layer3 != layer0
    # toggling a head off removes its lines; "none" removes all; "all" restores them
    page.click("#head-toggles .head-toggle[data-head='0']")
    renders = wait_renders(page, renders)
    without0 = lines(page)
    assert without0 == [entry for entry in layer3 if not entry.startswith("0:")] and len(without0) < len(layer3)
    assert page.get_attribute("#head-toggles .head-toggle[data-head='0']", "aria-pressed") == "false"
    page.click("#heads-none")
    renders = wait_renders(page, renders)
    assert lines(page) == []
    page.click("#heads-all")
    renders = wait_renders(page, renders)
    assert lines(page) == layer3
    # hovering a query keeps only its lines and shades the keys by its weights (rows sum to 1)
    page.hover("#head-svg text.query[data-index='2']")
    visible = page.eval_on_selector_all("#head-svg line:not(.hidden)", "ls => ls.map(l => l.dataset.q)")
    assert visible and set(visible) == {"2"}
    shades = page.eval_on_selector_all(
        "#head-svg g.keys rect.weight", "rs => rs.map(r => Number(r.getAttribute('fill-opacity')))"
    )
    assert abs(sum(shades) - 1.0) <= 0.01
    page.mouse.move(1200, 10)
    # a model-view cell opens that layer and head in the head view
    page.click("#model-grid canvas[data-layer='4'][data-head='7']")
    renders = wait_renders(page, renders)
    assert page.input_value("#layer-select") == "4"
    assert {entry.split(":")[0] for entry in lines(page)} == {"7"}
    # the second sentence
    page.select_option("#example-select", "1")
    wait_renders(page, renders)
    assert "banana" in texts(page, "query")
    page.screenshot(path=str(tmp_path / "static.png"), full_page=True)
    assert (tmp_path / "static.png").stat().st_size > 10_000
    assert watch.errors == []
    assert blocked == [] and all(url.startswith("file:") for url in watch.requests)
    context.close()


def test_static_seq2seq_views(browser, seq2seq_explorer, tmp_path):
    html = write_html(explorer_data([seq2seq_explorer.example("a dog runs on the beach")]), tmp_path / "s2s.html")
    blocked: list[str] = []
    context, page = offline_page(browser, blocked)
    watch = Watch(page)
    page.goto(html.as_uri())
    renders = wait_renders(page, 0)
    options = page.eval_on_selector_all("#view-select option", "os => os.map(o => o.textContent)")
    assert options == ["encoder self-attention", "decoder self-attention", "cross-attention"]
    source = texts(page, "query")
    assert source == ["a", "dog", "runs", "on", "the", "beach", "</s>"]
    page.select_option("#view-select", "1")
    renders = wait_renders(page, renders)
    decoder = lines(page)
    decoder_inputs = texts(page, "query")
    assert decoder_inputs[0] == "<s>"
    assert all(int(k) <= int(q) for _, q, k, _ in (e.split(":") for e in decoder))  # causal
    page.select_option("#view-select", "2")
    wait_renders(page, renders)
    # cross-attention rows are labelled by the token each decoder position predicts (its input shifted by one)
    assert texts(page, "key") == source and texts(page, "query") == decoder_inputs[1:] + ["</s>"]
    assert lines(page) != decoder
    page.screenshot(path=str(tmp_path / "seq2seq.png"), full_page=True)
    assert watch.errors == [] and blocked == []
    context.close()


def test_qkv_serve_in_the_browser(browser, minilm, seq2seq_explorer, tmp_path):
    app = ExplorerApp(
        explorers={
            "all-MiniLM-L6-v2": EncoderExplorer(model=minilm, name="all-MiniLM-L6-v2"),
            "tiny-translator": seq2seq_explorer,
        },
        max_chars=200,
    )
    httpd = make_server(app, host="127.0.0.1", port=0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{httpd.server_address[1]}"
    context = browser.new_context(viewport={"width": 1320, "height": 900})
    blocked: list[str] = []

    def only_local(route):
        if route.request.url.startswith(origin + "/"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", only_local)
    page = context.new_page()
    watch = Watch(page)
    try:
        page.goto(origin + "/")
        renders = wait_renders(page, 0)
        assert texts(page, "query")[1:3] == ["time", "flies"]
        # type a sentence: the server runs the model and the explorer redraws
        page.fill("#live-text", "fruit flies like a banana")
        page.click("#live-submit")
        renders = wait_renders(page, renders)
        assert "banana" in texts(page, "query")
        assert page.locator("#example-select option").count() == 2
        first = lines(page)
        page.select_option("#layer-select", "5")
        renders = wait_renders(page, renders)
        assert lines(page) != first
        page.click("#head-toggles .head-toggle[data-head='3']")
        renders = wait_renders(page, renders)
        assert not [e for e in lines(page) if e.startswith("3:")]
        # the translation model named at start-up
        page.select_option("#live-model", "1")
        page.fill("#live-text", "a dog runs")
        page.click("#live-submit")
        renders = wait_renders(page, renders)
        assert page.locator("#view-select option").count() == 3
        page.screenshot(path=str(tmp_path / "serve.png"), full_page=True)
        assert watch.errors == []
        # a bad request: the server answers 400 and the page shows its message
        page.fill("#live-text", "   ")
        page.click("#live-submit")
        page.wait_for_selector("#error:not([hidden])")
        assert "non-empty string" in page.text_content("#error")
        status = page.evaluate(
            "fetch('/api/attend', {method: 'POST', headers: {'Content-Type': 'application/json'}, body: '{oops'})"
            ".then(r => r.status)"
        )
        assert status == 400
        assert watch.errors and all("status of 400" in e for e in watch.errors)  # the browser logs the 400s only
        assert blocked == [] and all(url.startswith(origin) for url in watch.requests)
    finally:
        context.close()
        httpd.shutdown()
        httpd.server_close()
