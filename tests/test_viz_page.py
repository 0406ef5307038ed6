"""The explorer page's packed weights (qkv.viz.html.pack_weights, unpacked by core.js).

Each view's attention and rollout travel in the page as zlib-compressed uint16 units of 0.0001:
weights of 0.01 and more (every line drawn) exactly, smaller ones rounded to within 0.0002 and
never up to 0.01. Checked here against the document's own numbers, decoded in the test with
base64/zlib/numpy from the format's description, and in Debian's headless Chromium.
"""

from __future__ import annotations

import base64
import copy
import zlib

import numpy as np
import pytest
import torch

from qkv.viz import AttentionView, explorer_data, make_example, write_html
from qkv.viz.html import json_for_script, pack_weights, packed_for_page, page_document, render_html

# weights around the two places that matter: the line threshold 0.01 and the 0.0005 steps below it
EDGES = [
    0.0,
    0.0001,
    0.0002,
    0.0003,
    0.0005,
    0.0007,
    0.0024,
    0.0025,
    0.0026,
    0.0097,
    0.0098,
    0.0099,
    0.01,
    0.0101,
    0.0123,
    0.5,
    0.9999,
    1.0,
]


def decoded(packed: dict) -> np.ndarray:
    """The format as its docstring states it: base64 -> zlib -> high bytes, then low bytes -> / scale."""
    raw = np.frombuffer(zlib.decompress(base64.b64decode(packed["data"])), dtype=np.uint8)
    n = raw.size // 2
    return ((raw[:n].astype(np.int64) * 256 + raw[n:]) / packed["scale"]).reshape(packed["shape"])


def assert_packed_close(got: np.ndarray, exact: np.ndarray, slack: float = 0.0) -> None:
    """Weights >= 0.01 equal (within `slack`), smaller ones within 0.0002 (+ slack) and still < 0.01."""
    big = exact >= 0.01
    assert np.abs(got[big] - exact[big]).max(initial=0) <= slack
    assert np.abs(got - exact).max() <= 2e-4 + slack + 1e-12
    assert (got[~big] < 0.01).all()


def assert_page_holds(page: dict, data: dict) -> None:
    """`page` (qkv.viz.html.page_document of a page) is the document `data`, its attention and rollout
    weights of 0.01 and more equal and smaller ones within 0.0002 (and still under 0.01)."""
    page, data = copy.deepcopy(page), copy.deepcopy(data)
    assert len(page.get("examples", [])) == len(data.get("examples", []))
    for example, shown in zip(data.get("examples", []), page.get("examples", [])):
        assert len(example["views"]) == len(shown["views"])
        for view, drawn in zip(example["views"], shown["views"]):
            for key in ("attention", "rollout"):
                assert (key in view) == (key in drawn), key
                if key in view:
                    assert_packed_close(
                        np.array(drawn.pop(key), dtype=np.float64), np.array(view.pop(key), dtype=np.float64)
                    )
    assert page == data


def test_pack_weights_keeps_every_line_and_rounds_only_small_weights():
    rng = np.random.default_rng(0)
    grid = rng.dirichlet(np.full(40, 0.3), size=(2, 3, 40)).round(4)  # (L, H, s_q, s_k), 4 decimals
    grid[0, 0, 0, : len(EDGES)] = EDGES
    packed = pack_weights(grid.tolist())
    assert packed["packed"] == "qkv-weights/1" and packed["shape"] == [2, 3, 40, 40]
    got = decoded(packed)
    assert_packed_close(got, grid)
    below = got[grid < 0.01]
    assert np.all(np.isclose(below * 2000, np.rint(below * 2000)) | np.isclose(below, 0.0099))  # 0.0005 steps
    assert got[0, 0, 0, : len(EDGES)].tolist() == pytest.approx(
        [
            0.0,
            0.0,
            0.0,
            0.0005,
            0.0005,
            0.0005,
            0.0025,
            0.0025,
            0.0025,
            0.0095,
            0.0099,
            0.0099,
            0.01,
            0.0101,
            0.0123,
            0.5,
            0.9999,
            1.0,
        ],
        abs=1e-12,
    )


@pytest.mark.parametrize("grid", [[[0.12345, 0.5]], [[-0.1, 0.5]], [[7.0, 0.5]], []])
def test_weights_off_the_4_decimal_grid_stay_json(grid):
    assert pack_weights(grid) is None


def test_the_page_is_smaller_and_the_callers_document_unchanged():
    rng = np.random.default_rng(1)
    att = [torch.softmax(torch.tensor(rng.normal(size=(4, 64, 64)) * 3), -1) for _ in range(2)]
    words = [f"w{i}" for i in range(64)]
    data = explorer_data([make_example(" ".join(words), [AttentionView("self-attention", words, words, att)])])
    before = copy.deepcopy(data)
    page_data = packed_for_page(data)
    assert data == before  # not modified in place
    assert isinstance(page_data["examples"][0]["views"][0]["attention"], dict)
    assert len(json_for_script(page_data)) < len(json_for_script(data)) / 5
    page = render_html(data)
    assert data == before
    shown = page_document(page)
    exact = np.array(data["examples"][0]["views"][0]["attention"])
    assert_packed_close(np.array(shown["examples"][0]["views"][0]["attention"]), exact)


def test_the_browser_unpacks_what_python_packed(tmp_path):
    from chromium import chromium
    from test_browser import Watch, offline_page, wait_renders

    n = 24
    rng = np.random.default_rng(2)
    heads = torch.softmax(torch.tensor(rng.normal(size=(2, n, n)) * 4), -1)
    heads[0, 0] = 0.0
    heads[0, 0, : len(EDGES)] = torch.tensor(EDGES, dtype=heads.dtype)  # 0.01 itself must draw a line
    words = [f"t{i}" for i in range(n)]
    view = AttentionView("self-attention", words, words, [heads, heads.flip(0)])
    data = explorer_data([make_example(" ".join(words), [view])])
    html = write_html(data, tmp_path / "packed.html")
    exact = np.array(data["examples"][0]["views"][0]["attention"])
    with chromium() as browser:
        blocked: list[str] = []
        context, page = offline_page(browser, blocked)
        watch = Watch(page)
        page.goto(html.as_uri())
        wait_renders(page, 0)
        unpacked = np.array(
            page.evaluate(
                "() => window.qkvExplorer.data.examples[0].views[0].attention"
                ".map(layer => layer.map(head => head.map(row => Array.from(row))))"
            )
        )
        kinds = page.evaluate(
            "() => window.qkvExplorer.data.examples[0].views[0].attention[0][0].map(row => row.constructor.name)"
        )
        assert set(kinds) == {"Float32Array"}
        assert_packed_close(unpacked, exact, slack=6e-8)  # float32 rounding of 4-decimal numbers
        # layer 0, every head: one line per weight of at least 0.01 in the JSON, 0.01 included
        assert int(page.get_attribute("#head-svg", "data-lines")) == int((exact[0] >= 0.01).sum())
        drawn = page.eval_on_selector_all(
            "#head-svg line[data-head='0'][data-q='0']",
            "ls => ls.map(l => [+l.dataset.k, l.getAttribute('stroke-opacity')])",
        )
        assert drawn == [[k, f"{w:.4f}"] for k, w in enumerate(EDGES) if w >= 0.01]
        assert watch.errors == [] and blocked == []
        context.close()


def test_a_long_head_view_saved_as_png_has_its_lines(tmp_path):
    """Over 4,000 lines the PNG strokes them batched by colour and opacity level (figure.js): the
    focused query's lines reach the keys the JSON gives 0.05 or more and none it gives under 0.01
    (lighter lines are a few levels from white, too faint to tell from the edges of others)."""
    from chromium import chromium
    from explorer_documents import long_document
    from PIL import Image
    from test_browser import Watch, offline_page, wait_renders

    data = long_document(tokens=300, layers=1, heads=2, seed=3)  # head 1: 4,209 lines
    weights = np.array(data["examples"][0]["views"][0]["attention"][0])  # (heads, s, s)
    html = write_html(data, tmp_path / "long.html")
    query = 237  # near its row: 0.073 and 0.215 (and three lines of 0.018-0.027)
    with chromium() as browser:
        blocked: list[str] = []
        context, page = offline_page(browser, blocked)
        watch = Watch(page)
        page.goto(html.as_uri())
        wait_renders(page, 0)
        assert page.get_attribute("#head-svg", "data-mode") == "canvas"  # over 4,000 lines
        page.click("#head-toggles .head-toggle[data-head='0']")  # head 1 alone
        page.hover(f"#head-svg text.query[data-index='{query}']")
        geometry = page.evaluate(
            """(q) => {
            const s = document.getElementById('head-svg');
            const y = t => +t.getAttribute('y');
            return { width: window.qkvExplorer.tab('attention').figures['head-view']().width,
                     end: +s.querySelector('text.key').getAttribute('x') - 6,
                     start: +s.querySelector('text.query').getAttribute('x') + 6,
                     yq: y(s.querySelector(`text.query[data-index='${q}']`)),
                     yk: Array.from(s.querySelectorAll('text.key'), y) }; }""",
            query,
        )
        with page.expect_download() as info:
            page.evaluate("() => window.qkvExplorer.save('head-view', 'png')")
        image = Image.open(info.value.path()).convert("RGB")
        assert watch.errors == [] and blocked == []
        context.close()
    scale = image.width / geometry["width"]
    x, gap = geometry["end"] - 3, geometry["end"] - geometry["start"]

    def inked(yk: float) -> bool:  # any pixel near where the line to this key passes x is not white
        y = 34 + yk + (geometry["yq"] - yk) * 3 / gap  # 34: the title above the drawing
        pixels = [
            image.getpixel((round((x + dx) * scale), round((y + dy) * scale))) for dx in (-1, 0, 1) for dy in (-1, 0, 1)
        ]
        return any(min(px) < 250 for px in pixels)

    near = range(query - 12, query + 13)  # where the lines are not so steep that neighbours overlap
    strong = [k for k in near if weights[1, query, k] >= 0.05]
    absent = [k for k in near if weights[1, query, k] < 0.01]
    assert len(strong) == 2 and len(absent) == 20
    assert all(inked(geometry["yk"][k]) for k in strong)
    assert not any(inked(geometry["yk"][k]) for k in absent)
