"""Long inputs in the explorer (issue 69): the reduced form of a view's weights (each row's largest
weights and block means, qkv.viz.long_inputs) against numpy computed here by other means, its packing
for the page, and a 4,096-token page in Debian's Chromium (drawn, heads switched, hovered)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from chromium import chromium

from qkv.viz import AttentionView, explorer_data, long_inputs, make_example, render_html
from qkv.viz.analysis import view_fields
from qkv.viz.export import check_data
from qkv.viz.html import page_document


def causal_weights(rng: np.random.Generator, heads: int, n: int, sharpness: float = 4.0) -> np.ndarray:
    """``(heads, n, n)`` causal rows summing to 1, some with exact ties (uniform rows)."""
    logits = rng.normal(size=(heads, n, n)) * sharpness
    logits[:, ::5] = 0.0  # every fifth row uniform over its prefix: ties everywhere
    logits[:, np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -np.inf
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def numpy_top_k(matrix: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k largest 4-decimal weights, largest first, ties to the lower key (a stable sort)."""
    rounded = np.round(matrix, 4)
    index = np.array([sorted(range(len(row)), key=lambda j: (-row[j], j))[:k] for row in rounded])
    return index, np.take_along_axis(rounded, index, -1)


def numpy_block_means(matrix: np.ndarray, b_q: int, b_k: int) -> np.ndarray:
    """The mean of each b_q x b_k block, by loops over the blocks."""
    s_q, s_k = matrix.shape
    out = np.zeros((-(-s_q // b_q), -(-s_k // b_k)))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = matrix[i * b_q : (i + 1) * b_q, j * b_k : (j + 1) * b_k].mean()
    return out


def test_reduced_form_is_the_models_top_k_and_block_means():
    rng = np.random.default_rng(0)
    layers = [causal_weights(rng, 3, 45), causal_weights(rng, 3, 45)]
    reduced = long_inputs.reduce_weights([torch.from_numpy(w) for w in layers], k=6, cells=8)
    assert reduced["shape"] == [2, 3, 45, 45] and reduced["k"] == 6 and reduced["block"] == [6, 6]
    for layer_index, layer in enumerate(layers):
        for h, matrix in enumerate(layer):
            index, weight = numpy_top_k(matrix, 6)
            assert np.array_equal(reduced["index"][layer_index][h], index)
            assert np.array_equal(reduced["weight"][layer_index][h], weight)
            np.testing.assert_allclose(reduced["blocks"][layer_index][h], numpy_block_means(matrix, 6, 6), atol=1e-8)
    long_inputs.check_reduced(reduced, (2, 3, 45, 45), "view")


def test_cross_shaped_rollout_shaped_and_short_rows():
    rng = np.random.default_rng(1)
    w = rng.dirichlet(np.ones(7), size=(2, 30))  # (L, s_q, s_k): a rollout's shape, fewer keys than K
    reduced = long_inputs.reduce_weights(torch.from_numpy(w), k=8, cells=4)
    assert reduced["k"] == 7 and reduced["block"] == [8, 2]
    for layer in range(2):
        index, weight = numpy_top_k(w[layer], 7)
        assert np.array_equal(reduced["index"][layer], index) and np.array_equal(reduced["weight"][layer], weight)
        np.testing.assert_allclose(reduced["blocks"][layer], numpy_block_means(w[layer], 8, 2), atol=1e-8)


def torch_causal_weights(heads: int, n: int, seed: int, sharpness: float = 4.0) -> np.ndarray:
    """As :func:`causal_weights`, made faster with torch (a 4,096-token head has 16.8 million weights)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(heads, n, n, generator=generator) * sharpness
    logits[:, ::5] = 0.0
    logits.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1).numpy()


def long_view(n: int, heads: int = 2, layers: int = 1, seed: int = 0) -> tuple[AttentionView, list[np.ndarray]]:
    if n > 1000:
        weights = [torch_causal_weights(heads, n, seed + layer) for layer in range(layers)]
    else:
        rng = np.random.default_rng(seed)
        weights = [causal_weights(rng, heads, n).astype(np.float32) for _ in range(layers)]
    tokens = [f"t{i % 97}" for i in range(n)]
    return AttentionView("causal self-attention", tokens, tokens, [torch.from_numpy(w) for w in weights]), weights


def test_a_view_over_the_limit_is_reduced_checked_and_packed(monkeypatch):
    monkeypatch.setattr(long_inputs, "FULL_WEIGHTS_LIMIT", 2 * 2 * 40 * 40 - 1)
    view, weights = long_view(40, layers=2)
    example = make_example("long", [view])
    example["views"][0].update(view_fields(view))
    data = explorer_data([example])
    check_data(data)
    attention, rollout = data["examples"][0]["views"][0]["attention"], data["examples"][0]["views"][0]["rollout"]
    assert long_inputs.is_reduced(attention)
    assert isinstance(rollout, list)  # 2 x 40 x 40 weights: under the limit, every weight kept
    index, weight = numpy_top_k(weights[1][0].astype(np.float64), long_inputs.TOP_K)
    assert np.array_equal(attention["index"][1][0], index) and np.array_equal(attention["weight"][1][0], weight)
    inside = page_document(render_html(data))["examples"][0]["views"][0]["attention"]  # packed and back
    assert inside["index"] == attention["index"] and inside["weight"] == attention["weight"]
    np.testing.assert_allclose(inside["blocks"], attention["blocks"], rtol=1e-6, atol=1e-12)  # float32
    bad = dict(attention, index=np.full((2, 2, 40, attention["k"]), 40).tolist())
    data["examples"][0]["views"][0]["attention"] = bad
    with pytest.raises(ValueError, match="'index' must hold key positions below 40"):
        check_data(data)
    data["examples"][0]["views"][0]["attention"] = dict(attention, shape=[2, 2, 40, 41])
    with pytest.raises(ValueError, match="reduced weights of shape"):
        check_data(data)


# --- a 4,096-token page in a real browser -------------------------------------------------------


@pytest.fixture(scope="module")
def long_page(tmp_path_factory):
    view, weights = long_view(4096, heads=2, layers=1, seed=3)
    path = tmp_path_factory.mktemp("long") / "long.html"
    with pytest.MonkeyPatch.context() as patch:  # 2 heads x 4,096^2 is the limit itself: reduce them
        patch.setattr(long_inputs, "FULL_WEIGHTS_LIMIT", 1 << 24)
        data = explorer_data([make_example("a long text", [view], model="random")])
    assert long_inputs.is_reduced(data["examples"][0]["views"][0]["attention"])
    path.write_text(render_html(data))
    return path, weights[0].astype(np.float64)


def lines_drawn(weights: np.ndarray, heads: list[int]) -> int:
    """Lines of the head view: per row, its K largest weights that are 0.01 or more (4 decimals)."""
    big = (np.round(weights[heads], 4) >= 0.01).sum(-1)
    return int(np.minimum(big, long_inputs.TOP_K).sum())


@pytest.fixture(scope="module")
def page(long_page):
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1320, "height": 900})  # as wide as the other screenshots
        context.set_offline(True)
        tab = context.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda err: errors.append(str(err)))
        tab.goto(long_page[0].as_uri())
        tab.wait_for_function("() => Number(document.body.dataset.renders || 0) > 0", timeout=60_000)
        yield tab, errors


def test_a_4096_token_page_shows_a_picture(page, long_page):
    tab, errors = page
    weights = long_page[1]
    svg = tab.locator("#head-svg")
    assert svg.get_attribute("data-mode") == "virtual"
    assert int(svg.get_attribute("data-lines")) == lines_drawn(weights, [0, 1])
    assert tab.locator("#head-svg *").count() == 0  # no element per token or line: the canvas paints the rows in view
    first, last = int(svg.get_attribute("data-first-row")), int(svg.get_attribute("data-last-row"))
    assert first == 0 and 20 < last < 200
    inked = """(selector) => { const c = document.querySelector(selector); const d = c.getContext('2d')
        .getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < d.length; i += 4) { if (d[i] < 200 || d[i + 1] < 200) { n++; } } return n; }"""
    assert tab.evaluate(inked, ".lines-host canvas.lines-canvas") > 500  # labels and lines
    assert tab.evaluate(inked, "#head-overview") > 100
    assert tab.locator("#model-grid canvas.cell").count() == 2
    note = tab.locator("#head-view p.long-note").text_content()
    assert "4,096 \u00d7 4,096 tokens" in note and "8 largest weights" in note and "32 \u00d7 32-token block" in note
    assert not errors
    # docs/explorer_long.png when QKV_SCREENSHOT_DIR is set: the page's top 840 px (the dense lines keep the PNG small)
    folder = os.environ.get("QKV_SCREENSHOT_DIR")
    if folder:
        clip = {"x": 0, "y": 0, "width": 820, "height": 840}
        tab.screenshot(path=os.path.join(folder, "explorer_long.png"), clip=clip)


def test_switching_heads_scrolling_and_hovering(page, long_page):
    tab, errors = page
    weights = long_page[1]
    renders = int(tab.evaluate("() => document.body.dataset.renders"))
    tab.click("#head-toggles button[data-head='0']")  # head 0 off: head 1 alone
    tab.wait_for_function(f"() => Number(document.body.dataset.renders) > {renders}")
    assert int(tab.get_attribute("#head-svg", "data-lines")) == lines_drawn(weights, [1])
    assert tab.get_attribute("#head-overview", "data-heads") == "1"
    tab.evaluate("() => { document.querySelector('#head-svg').parentNode.scrollTop = 45000; }")
    tab.wait_for_function("() => Number(document.querySelector('#head-svg').dataset.firstRow) > 2900")
    first = int(tab.get_attribute("#head-svg", "data-first-row"))
    box = tab.locator("#head-svg").bounding_box()
    host = tab.locator("#head-view .lines-host").bounding_box()
    row = first + 5
    y = box["y"] + 8 + 15 * row + 7  # the row's middle (longlines.js: 8 px padding, 15 px rows)
    assert host["y"] < y < host["y"] + host["height"]
    tab.mouse.move(box["x"] + 10, y)
    focus = tab.evaluate("() => document.querySelector('#head-svg').qkvLines.focus")
    assert focus == {"side": "query", "index": row}
    shades = tab.evaluate("() => Array.from(document.querySelector('#head-svg').qkvLines.shades.key)")
    index, weight = numpy_top_k(weights[1, row : row + 1], long_inputs.TOP_K)
    expected = np.zeros(4096)
    expected[index[0]] = weight[0]
    np.testing.assert_allclose(shades, expected, atol=1e-6)  # one head on: its K largest weights of that row
    assert not errors


# --- a translation model on a 4,096-token source document --------------------------------------


@pytest.mark.slow  # about 40 s on one core: the model, the page and numpy's 4,096^3 rollout reference
def test_a_translation_of_a_4096_token_document_builds_opens_and_draws(tmp_path):
    from test_viz import WordTokenizer

    from qkv import Transformer, TransformerConfig
    from qkv.viz import Seq2SeqExplorer

    tokenizer = WordTokenizer(["a", "dog", "runs", "on", "the", "beach", "ein", "hund", "läuft", "am", "strand"])
    torch.manual_seed(5)
    config = TransformerConfig(
        src_vocab_size=15,
        tgt_vocab_size=15,
        d_model=32,
        num_heads=2,
        num_encoder_layers=3,  # 3 layers x 4,096^2: the encoder's rollout too is over the limit, reduced
        num_decoder_layers=1,
        d_ff=64,
        max_len=4096,
        dropout=0.0,
    )
    explorer = Seq2SeqExplorer(model=Transformer(config).eval(), tokenizer=tokenizer, name="random", max_new_tokens=4)
    words = ["a", "dog", "runs", "on", "the", "beach"]
    document = " ".join(words[i % len(words)] for i in range(4095))  # 4,095 words and </s>
    target = "ein hund läuft"
    example = explorer.example(document, target)
    encoder, decoder, cross = example["views"]
    assert len(encoder["keys"]) == 4096 and len(cross["queries"]) == 4
    assert long_inputs.is_reduced(encoder["attention"]) and long_inputs.is_reduced(encoder["rollout"])
    assert isinstance(cross["attention"], list) and isinstance(cross["rollout"], list)  # 1 x 2 x 4 x 4,096: exact
    # the first encoder layer's top weights against the recorded weights, ranked here by numpy
    views = explorer.views(document, target)
    first = views[0].attentions[0].double().numpy()  # (heads, 4,096, 4,096)
    index, weight = numpy_top_k(first[1, 100:110], long_inputs.TOP_K)
    assert np.array_equal(np.asarray(encoder["attention"]["index"][0][1][100:110]), index)
    assert np.array_equal(np.asarray(encoder["attention"]["weight"][0][1][100:110]), weight)
    # cross-attention rollout: each layer's mean over heads (rows renormalised) times the encoder's full rollout
    flow = np.eye(4096)
    for layer in views[0].attentions:
        mixed = layer.double().numpy().mean(0) + np.eye(4096)
        flow = (mixed / mixed.sum(-1, keepdims=True)) @ flow
    mean = views[2].attentions[0].double().numpy().mean(0)
    np.testing.assert_allclose(cross["rollout"][0], (mean / mean.sum(-1, keepdims=True)) @ flow, atol=2e-4)
    data = explorer_data([example])
    check_data(data)
    path = tmp_path / "translation.html"
    path.write_text(render_html(data))
    with chromium() as browser:
        tab = browser.new_context(viewport={"width": 1320, "height": 900}).new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda err: errors.append(str(err)))
        tab.goto(path.as_uri())
        tab.wait_for_function("() => Number(document.body.dataset.renders || 0) > 0", timeout=60_000)
        svg = tab.locator("#head-svg")  # the encoder's self-attention first: the reduced form's lines
        assert svg.get_attribute("data-mode") == "virtual"
        assert int(svg.get_attribute("data-lines")) == lines_drawn(first, [0, 1])
        assert tab.locator("#model-grid canvas.cell").count() == 3 * 2
        assert not errors
