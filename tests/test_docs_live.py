"""docs/live.md in a real browser: the language model's attention computed by ONNX Runtime Web, and the
by-hand example, on the page as built by docs_hooks/qkv_live.py, opened from a local folder (file://)
with every request that is not a file aborted.

The references are computed here, differently: qkv's own :class:`~qkv.models.causal_lm.CausalLM`
(rebuilt from the graph's parameters) through :class:`~qkv.viz.lm_explorer.CausalLMExplorer`, the
code ``qkv attend`` runs; ``qkv explain``'s printed matrices; numpy by hand for edited inputs.

Needs Debian's chromium and ONNX Runtime Web (``npm ci --prefix web``): skipped without them, unless
``QKV_DOCS_REQUIRE_WEB=1`` (CI), which makes a missing ONNX Runtime Web a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from chromium import chromium, playwright_or_skip

ROOT = Path(__file__).resolve().parent.parent
playwright_or_skip(module=True)
pytest.importorskip("mkdocs")
pytest.importorskip("onnx")


def _hook():
    spec = importlib.util.spec_from_file_location("qkv_live_hook", ROOT / "docs_hooks" / "qkv_live.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _hook()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The live page built with the docs' own mkdocs.yml (its theme, extensions and hooks), alone."""
    if not (hook.ORT_DIST / hook.ORT_FILES["wasm"]).is_file():
        why = f"ONNX Runtime Web is not installed in {hook.ORT_DIST} (npm ci --prefix web)"
        if os.environ.get("QKV_DOCS_REQUIRE_WEB") == "1":
            pytest.fail(why + " and QKV_DOCS_REQUIRE_WEB=1")
        pytest.skip(why)
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    base = tmp_path_factory.mktemp("live")
    docs = base / "docs"
    (docs / "assets").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "live.md", docs / "live.md")
    shutil.copytree(ROOT / "docs" / "assets" / "live", docs / "assets" / "live")
    config = load_config(
        config_file=str(ROOT / "mkdocs.yml"),
        docs_dir=str(docs),
        site_dir=str(base / "site"),
        nav=[{"Live": "live.md"}],
        plugins=["search"],  # not mkdocstrings: no API pages here
        validation={"links": {"not_found": "info"}},  # the page links pages not built here
    )
    build(config)
    return base / "site"


@pytest.fixture(scope="module")
def browser():
    with chromium() as instance:
        yield instance


@pytest.fixture(scope="module")
def page(browser, site):
    """The page from file://, every other request aborted (and listed in ``page.blocked``)."""
    context = browser.new_context()
    blocked: list[str] = []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda err: errors.append(str(err)))
    tab.goto((site / "live" / "index.html").as_uri())
    tab.wait_for_function("window.qkvLive && (window.qkvLive.runs > 0 || window.qkvLive.error)", timeout=30_000)
    assert tab.evaluate("window.qkvLive.error") is None, tab.text_content("#qkv-live-status")
    tab.blocked = blocked
    tab.errors = errors
    yield tab
    context.close()


@pytest.fixture(scope="module")
def explorer():
    """qkv's explorer of the live model: the code qkv attend runs, over qkv's CausalLM with the graph's parameters."""
    from qkv.data.text import load_text_tokenizer
    from qkv.export.onnx_attention import model_from_onnx
    from qkv.viz.lm_explorer import CausalLMExplorer

    model = model_from_onnx(hook.MODEL_DIR)
    tokenizer = load_text_tokenizer(hook.MODEL_DIR / "tokenizer.json")
    return CausalLMExplorer(model=model, tokenizer=tokenizer, name="live")


def _type(page, text: str) -> dict:
    runs = page.evaluate("window.qkvLive.runs")
    page.fill("#qkv-live-input", text)
    page.wait_for_function(
        "([runs, text]) => window.qkvLive.runs > runs && window.qkvLive.result.text === text", arg=[runs, text]
    )
    return page.evaluate("window.qkvLive.result")


@pytest.mark.parametrize(
    "text",
    [
        "To be, or not to be: that is the question.",
        "A",  # one character: a 1 x 1 attention
        # longer than the context (64): the last 64 characters, as qkv attend keeps
        "Now is the winter of our discontent made glorious summer by this sun of York;",
    ],
)
def test_browser_weights_are_qkvs(page, explorer, text):
    got = _type(page, text)
    ids, _ = explorer._ids(text)
    assert got["ids"] == ids  # the page's character ids are qkv's tokenizer's
    (view,) = explorer.views(text)
    assert got["tokens"] == list(text)[-len(ids) :]
    assert len(got["attentions"]) == len(view.attentions) == 2
    for layer, expected in zip(got["attentions"], view.attentions, strict=True):
        mine = np.array(layer)  # (h, s, s)
        assert mine.shape == tuple(expected.shape)
        np.testing.assert_allclose(mine, expected.numpy(), atol=1e-5, rtol=0)
    with torch.no_grad():
        logits = explorer.model(torch.tensor([ids])).logits[0, -1]
    probs = torch.softmax(logits.double(), -1)
    best = probs.argsort(descending=True)[:5]
    assert [c for c, _ in got["next"]] == [explorer.tokenizer.chars[int(i)] for i in best]
    np.testing.assert_allclose([p for _, p in got["next"]], probs[best].numpy(), atol=1e-5, rtol=0)


def test_hovered_weight_is_shown(page, explorer):
    text = "ROMEO: But soft"
    got = _type(page, text)
    page.click("canvas.qkv-live-thumb[data-layer='1'][data-head='2']")
    box = page.locator("#qkv-live-map").bounding_box()
    s = len(got["ids"])
    q, k = 11, 4
    page.mouse.move(box["x"] + (k + 0.5) * box["width"] / s, box["y"] + (q + 0.5) * box["height"] / s)
    shown = page.text_content("#qkv-live-cell")
    (view,) = explorer.views(text)
    weight = float(view.attentions[1][2, q, k])
    assert shown == f'query {q} "{text[q]}" \u2192 key {k} "{text[k]}": {weight:.4f}'
    assert page.text_content("#qkv-live-which") == "layer 1, head 2"


def test_unknown_characters_are_named(page):
    runs = page.evaluate("window.qkvLive.runs")
    page.fill("#qkv-live-input", "caf\u00e9 \u00e9t\u00e9")
    page.wait_for_function("document.getElementById('qkv-live-status').classList.contains('qkv-live-error')")
    assert '1 character not in the model\'s vocabulary of 65: "\u00e9"' in page.text_content("#qkv-live-status")
    assert page.evaluate("window.qkvLive.runs") == runs


def _explain_matrices() -> dict[str, np.ndarray]:
    """The rows convention's matrices ``qkv explain`` prints, by the first word(s) of their titles."""
    from qkv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["explain"]) == 0
    text = out.getvalue().split("== Convention 2")[0]
    matrices = {}
    for block in re.split(r"\n(?=\S.*\(\d+ x \d+\)\n)", text):
        title, _, body = block.partition("\n")
        match = re.match(r"(.*?)\s+\((\d+) x (\d+)\)$", title)
        if not match:
            continue
        rows = [re.findall(r"-?\d+\.\d+", line) for line in body.splitlines() if "[" in line]
        matrices[match[1].split("   (")[0]] = np.array(rows[: int(match[2])], dtype=float)
    return matrices


PAGE_NAMES = {  # the page's table -> qkv explain's title
    "X": "X",
    "W_Q": "W_Q",
    "W_K": "W_K",
    "W_V": "W_V",
    "Q": "Q",
    "K": "K",
    "V": "V",
    "S = Q K^T": "S = Q K^T",
    "S / sqrt(d_k)": "S / sqrt(d_k)",
    "A = softmax(S / sqrt(d_k))": "A = softmax(S / sqrt(d_k))",
    "Z = A V": "Z = A V",
}


def _table(page, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A by-hand table's full values (``data-v``) and what it shows (the text, or the input's value)."""
    cells = page.evaluate(
        """(name) => Array.from(document.querySelector(`table[data-matrix="${name}"]`).rows).slice(1).map(
             (tr) => Array.from(tr.querySelectorAll('td')).map((td) => {
               const input = td.querySelector('input');
               return [td.dataset.v, input ? input.value : td.textContent];
             }))""",
        name,
    )
    array = np.array(cells, dtype=object)
    return array[..., 0].astype(float), array[..., 1].astype(float)


def test_by_hand_numbers_are_qkv_explains(page):
    page.click("#qkv-hand-reset")
    expected = _explain_matrices()
    for name, title in PAGE_NAMES.items():
        values, shown = _table(page, name)
        assert shown.shape == expected[title].shape, name
        # qkv explain prints 3 decimals: the page's values round to them, and it shows the same
        np.testing.assert_allclose(values, expected[title], atol=5e-4 + 1e-9, rtol=0, err_msg=name)
        np.testing.assert_allclose(shown, expected[title], atol=1e-9, rtol=0, err_msg=name)


def test_by_hand_follows_edits(page):
    page.click("#qkv-hand-reset")
    x, _ = _table(page, "X")
    w = {name: _table(page, name)[0] for name in ("W_Q", "W_K", "W_V")}
    page.fill("table[data-matrix='X'] td[data-i='0'][data-j='0'] input", "1.5")
    page.fill("table[data-matrix='W_K'] td[data-i='2'][data-j='1'] input", "-0.7")
    x[0, 0], w["W_K"][2, 1] = 1.5, -0.7
    q, k, v = x @ w["W_Q"], x @ w["W_K"], x @ w["W_V"]
    scaled = q @ k.T / np.sqrt(3)
    a = np.exp(scaled) / np.exp(scaled).sum(1, keepdims=True)
    for name, expected in (("S / sqrt(d_k)", scaled), ("A = softmax(S / sqrt(d_k))", a), ("Z = A V", a @ v)):
        values, shown = _table(page, name)
        np.testing.assert_allclose(values, expected, atol=1e-12, rtol=0, err_msg=name)
        np.testing.assert_allclose(shown, expected, atol=5e-4 + 1e-9, rtol=0, err_msg=name)
    page.click("#qkv-hand-reset")
    assert _table(page, "X")[1][0, 0] != 1.5


def test_nothing_but_files_was_asked_for(page):
    # every test above ran with the network cut, and none asked for anything beyond the site's
    # folder (the theme's fonts are the system's: mkdocs.yml's font: false)
    assert page.blocked == []
    # and no script failed but the theme's search, whose worker cannot load its index from file://
    assert [err for err in page.errors if "/search/" not in err] == []


def test_the_hook_says_when_onnx_runtime_web_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("QKV_DOCS_REQUIRE_WEB", raising=False)
    text = hook.ort_runtime_js(tmp_path)
    assert text.startswith("window.QKV_ORT_MISSING = ") and "npm ci --prefix web" in text
    monkeypatch.setenv("QKV_DOCS_REQUIRE_WEB", "1")
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="npm ci --prefix web"):
        hook.ort_runtime_js(tmp_path)
