"""The explorer inside a notebook (qkv.viz.notebook): show / head_view / model_view and ExplorerView.

Unit tests check the notebook HTML (one sandboxed ``<iframe srcdoc>`` per view, nothing fetched),
``save`` against ``render_html`` and ``qkv attend``, and bertviz-style tensors against the page's
weights. One test runs a real Jupyter kernel (nbclient + ipykernel) on a notebook built here, puts
the executed outputs on one page as a front end would, and opens it in Debian's Chromium: every
explorer draws, in its own frame, the weights that Hugging Face transformers computes for the same
model.
"""

from __future__ import annotations

import os
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from chromium import chromium
from test_lm_explorer import TEXT_CHARS, independent_attention, lm_run  # noqa: F401  (lm_run: a fixture)

from qkv.cli import main
from qkv.viz import ExplorerView, head_view, model_view, open_explorer, render_html, show
from qkv.viz.html import page_document

SMALL = 2.6e-4  # the page keeps weights under 0.01 to within 0.0002 (html.pack_weights), plus 4-decimal rounding
EXACT = 6e-5  # weights of 0.01 and more: 4-decimal rounding (and float32 in the browser)


def random_attention(layers: int, heads: int, s_q: int, s_k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Per-layer (1, heads, s_q, s_k) rows that sum to 1, as transformers returns with output_attentions=True."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.softmax(3 * torch.randn(1, heads, s_q, s_k, generator=g), -1) for _ in range(layers))


TOKENS = ["[CLS]", "time", "flies", "like", "an", "arrow", "[SEP]"]


class Frames(HTMLParser):
    """The notebook HTML's elements: every tag with its attributes, the iframes' srcdoc unescaped."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def parsed(markup: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = Frames()
    parser.feed(markup)
    return parser.tags


REMOTE = re.compile(
    r"""(?:src|href|action)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//|@import""", re.I
)


def test_two_views_on_one_page_are_isolated_frames():
    one, two = (head_view(random_attention(2, 3, 7, 7, seed), TOKENS) for seed in (1, 2))
    markup = [one._repr_html_(), two._repr_html_()]
    ids = []
    for view, text in zip((one, two), markup):
        tags = parsed(text)
        assert [t for t, _ in tags] == ["div", "iframe"]  # no script, style or link on the notebook's page
        div, frame = tags[0][1], tags[1][1]
        ids.append(div["id"])
        assert frame["sandbox"].split() == ["allow-scripts", "allow-downloads"]  # no allow-same-origin
        assert frame["srcdoc"] == view.page == render_html(view.data)  # the whole page, unescaped by the parser
        assert f"height: {view.height}px" in div["style"] and 360 <= view.height <= 1000
    assert ids[0] != ids[1] and all(i.startswith("qkv-explorer-") for i in ids)
    # the same data shown twice still gets two frames apart
    again = ExplorerView(one.data)
    assert parsed(again._repr_html_())[0][1]["id"] not in ids


def test_repr_html_is_self_contained():
    view = model_view(random_attention(2, 2, 5, 5), TOKENS[:5])
    outer = view._repr_html_()
    inner = parsed(outer)[1][1]["srcdoc"]
    assert inner.startswith("<!DOCTYPE html>") and "default-src 'none'" in inner
    for text in (outer, inner):
        assert not REMOTE.search(text), REMOTE.search(text)
    # and the check above can fail: a page that loads a script from a CDN
    assert REMOTE.search('<script src="https://cdn.example/x.js">') and REMOTE.search("<link href='//cdn.x/a.css'>")


def test_save_writes_the_page_and_refuses_to_overwrite(tmp_path):
    view = head_view(random_attention(3, 2, 7, 7), TOKENS, layer=1, heads=[1])
    path = view.save(tmp_path / "a.html")
    assert path.read_bytes() == render_html(view.data).encode("utf-8")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        view.save(path)
    other = head_view(random_attention(3, 2, 7, 7, seed=5), TOKENS)
    other.save(path, overwrite=True)
    assert path.read_bytes() == render_html(other.data).encode("utf-8") != render_html(view.data).encode("utf-8")
    with pytest.raises(IsADirectoryError):
        view.save(tmp_path, overwrite=True)


def test_bertviz_style_attention_is_what_the_page_holds():
    attention = random_attention(3, 4, 7, 7, seed=3)
    view = head_view(attention, TOKENS, sentence_b_start=4, layer=2, heads=[0, 3])
    expected = torch.cat(attention).double().numpy()  # (layers, heads, s, s)
    data = view.data
    assert data["start"] == {"panel": "head-view", "layer": 2, "heads": [0, 3]}
    names = [v["name"] for v in data["examples"][0]["views"]]
    assert names == ["self-attention"] + [f"sentence {q} \u2192 {k}" for q in "AB" for k in "AB"]
    full = data["examples"][0]["views"][0]
    assert full["queries"] == full["keys"] == TOKENS
    np.testing.assert_allclose(np.array(full["attention"]), expected, atol=5.1e-5, rtol=0)
    # the page's copy (packed), as its JavaScript unpacks it
    page = page_document(view.page)["examples"][0]["views"]
    np.testing.assert_allclose(np.array(page[0]["attention"]), expected, atol=SMALL, rtol=0)
    big = expected >= 0.01
    assert np.abs(np.array(page[0]["attention"])[big] - expected[big]).max() <= EXACT
    # sentence B -> A: rows of B's tokens, columns of A's, the full matrix's block (not renormalised)
    b_to_a = page[3]
    assert b_to_a["queries"] == TOKENS[4:] and b_to_a["keys"] == TOKENS[:4]
    np.testing.assert_allclose(np.array(b_to_a["attention"]), expected[:, :, 4:, :4], atol=SMALL, rtol=0)
    # a stacked numpy array and per-layer (heads, s, s) arrays give the same weights
    for given in (np.stack([a.numpy() for a in attention]), [a[0].numpy() for a in attention]):
        again = model_view(given, TOKENS).data["examples"][0]["views"][0]["attention"]
        assert again == full["attention"]


def test_encoder_decoder_tensors_and_prettified_tokens():
    enc, dec, cross = random_attention(2, 2, 4, 4, 1), random_attention(2, 2, 3, 3, 2), random_attention(2, 2, 3, 4, 3)
    src, tgt = ["\u2581a", "\u2581dog", "\u2581runs", "</s>"], ["<pad>", "\u2581ein", "\u2581Hund"]
    view = model_view(
        encoder_attention=enc,
        decoder_attention=dec,
        cross_attention=cross,
        encoder_tokens=src,
        decoder_tokens=tgt,
        include_layers=[1],
    )
    assert view.data["start"] == {"panel": "model-view"}
    views = view.data["examples"][0]["views"]
    assert [v["name"].split(" (")[0] for v in views] == [
        "encoder self-attention",
        "decoder self-attention",
        "cross-attention",
    ]
    assert views[0]["keys"] == ["\u2423a", "\u2423dog", "\u2423runs", "</s>"] and views[2]["queries"][1] == "\u2423ein"
    for got, given in zip(views, (enc, dec, cross)):
        assert got["layers"] == 1 and "layers 1 of 2" in got["name"]
        np.testing.assert_allclose(np.array(got["attention"]), given[1].double().numpy(), atol=5.1e-5, rtol=0)
    assert "rollout" in views[2]  # the cross-attention read through the encoder's rollout
    gpt2 = head_view(random_attention(1, 1, 3, 3), ["The", "\u0120quick", "\u010a"]).data["examples"][0]["views"][0]
    assert gpt2["queries"] == ["The", "\u2423quick", "\u23ce"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: head_view(random_attention(2, 2, 7, 7), TOKENS[:5]), r"7 x 7 .* 5 tokens were given"),
        (lambda: head_view(tuple(torch.rand(2, 2, 7, 7) for _ in range(2)), TOKENS), "batch of 2 inputs"),
        (lambda: head_view(torch.rand(2, 7, 7), TOKENS), "stacked layers"),
        (lambda: head_view(random_attention(2, 2, 7, 7), None), "needs its tokens"),
        (lambda: head_view(random_attention(2, 2, 7, 7), "time flies"), "list of strings"),
        (lambda: head_view((torch.rand(1, 2, 7, 7), None), TOKENS), "layer 1 is None"),
        (lambda: head_view((torch.full((1, 2, 7, 7), float("nan")),), TOKENS), "NaN"),
        (lambda: head_view(random_attention(2, 2, 7, 7), TOKENS, layer=2), "layer must be below 2"),
        (lambda: head_view(random_attention(2, 2, 7, 7), TOKENS, heads=[5]), "below 2"),
        (lambda: head_view(random_attention(2, 2, 7, 7), TOKENS, sentence_b_start=7), "sentence_b_start"),
        (lambda: head_view(random_attention(2, 2, 7, 7), TOKENS, text="x"), "not for attention tensors"),
        (lambda: head_view(cross_attention=random_attention(1, 1, 2, 3), decoder_tokens=["a", "b"]), "encoder_tokens"),
        (lambda: show("/no/such/run", "a dog"), "no such run or model folder"),
        (lambda: show(42, "a dog"), "model_or_run must be"),
        (lambda: head_view("/no/such/run", "a dog", sentence_b_start=1), "only for attention tensors"),
        (lambda: ExplorerView({"format": "nope"}), "not a qkv-attention/1 document"),
    ],
)
def test_bad_inputs_are_one_line_errors(call, message):
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        call()
    assert re.search(message, str(err.value)) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def minilm_explorer():
    try:
        return open_explorer()
    except FileNotFoundError as err:
        pytest.skip(str(err))


def test_show_saves_the_file_qkv_attend_writes(minilm_explorer, tmp_path):
    texts = ["time flies like an arrow", "fruit flies like a banana"]
    view = show(minilm_explorer, texts)
    assert "compare" in view.data and len(view.data["examples"]) == 2
    assert main(["attend", *texts, "--compare", "-o", str(tmp_path / "attend.html")]) == 0
    view.save(tmp_path / "show.html")
    assert (tmp_path / "show.html").read_bytes() == (tmp_path / "attend.html").read_bytes()
    with pytest.raises(ValueError, match="target is for translation models"):
        show(minilm_explorer, "a dog", target="ein Hund")


def test_a_language_model_run_folder(lm_run, tmp_path):  # noqa: F811  (the fixture imported above)
    view = head_view(str(lm_run), "to be or not", layer=1)  # qkv's calling style, a run folder
    assert view.data["start"] == {"panel": "head-view", "layer": 1}
    (got,) = page_document(view.page)["examples"][0]["views"]
    ids = torch.tensor([[TEXT_CHARS.index(c) for c in "to be or not"]])
    model = open_explorer(lm_run).model.cpu()
    want = torch.stack(independent_attention(model, ids)).double().numpy()  # (layers, heads, s, s)
    assert got["name"] == "causal self-attention" and got["queries"][2] == "\u2423"
    np.testing.assert_allclose(np.array(got["attention"]), want, atol=SMALL, rtol=0)
    # show's page is the one qkv attend writes (two sentences: compared, as with --compare)
    assert (
        main(["attend", "to be or not", "that is", "--compare", "--model", str(lm_run), "-o", str(tmp_path / "a.html")])
        == 0
    )
    show(lm_run, ["to be or not", "that is"]).save(tmp_path / "s.html")
    assert (tmp_path / "s.html").read_bytes() == (tmp_path / "a.html").read_bytes()


# --------------------------------------------------------------------------- a real kernel, a real browser

CELLS = [
    "import torch\ntorch.set_num_threads(1)\nfrom qkv.viz import show, head_view, model_view, open_explorer\n"
    "explorer = open_explorer()  # all-MiniLM-L6-v2",
    'show(explorer, "time flies like an arrow")',
    'show(explorer, "the cat sat on the mat", height=520)',
    'batch = explorer.tokenizer(["a dog runs"])\n'
    "with torch.no_grad():\n"
    "    out = explorer.model(batch.input_ids, batch.attention_mask, output_attentions=True)\n"
    "attention = tuple(out.attentions)  # per layer (1, heads, s, s), as transformers returns\n"
    "head_view(attention, batch.tokens[0], layer=2)",
    "model_view(attention, batch.tokens[0])",
]
SENTENCES = ["time flies like an arrow", "the cat sat on the mat", "a dog runs", "a dog runs"]


def executed_notebook(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    nbclient.NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    return [
        out["data"]["text/html"]
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out["output_type"] == "execute_result" and "text/html" in out["data"]
    ]


def transformers_weights(sentences: list[str]) -> list[tuple[list[str], np.ndarray]]:
    """The reference: Hugging Face transformers' BertModel (eager) on all-MiniLM-L6-v2: each sentence's
    tokens and attention (layers, heads, s, s)."""
    transformers = pytest.importorskip("transformers")
    from qkv.pretrained import default_model_path

    path = str(default_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    out = []
    for sentence in sentences:
        inputs = tokenizer([sentence], return_tensors="pt")
        with torch.no_grad():
            attentions = model(**inputs, output_attentions=True).attentions
        out.append((tokenizer.convert_ids_to_tokens(inputs["input_ids"][0]), torch.cat(attentions).double().numpy()))
    return out


@pytest.fixture(scope="module")
def browser():
    with chromium() as instance:
        yield instance


class NotebookPage:
    """The outputs' HTML one under another on one page, as a notebook front end shows them, opened
    offline: ``frames`` are the explorers' frames once each has drawn."""

    def __init__(self, browser, outputs: list[str], tmp_path):
        self.file = tmp_path / "notebook.html"
        body = "".join(f'<div class="output_html">{out}</div>\n' for out in outputs)
        self.file.write_text(f'<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>{body}</body></html>')
        self.context = browser.new_context(viewport={"width": 1300, "height": 900})
        self.context.set_offline(True)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", lambda route: (self.requests.append(route.request.url), route.continue_()))
        self.page = self.context.new_page()
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(self.file.as_uri())
        self.frames = [handle.content_frame() for handle in self.page.query_selector_all("iframe")]
        for frame in self.frames:
            frame.wait_for_function("Number(document.body && document.body.dataset.renders || 0) > 0", timeout=30_000)

    def held(self, frame, view: int = 0) -> np.ndarray:
        """The weights the frame's page holds for its first example's view (as its JavaScript unpacked them)."""
        return np.array(
            frame.evaluate(
                "v => window.qkvExplorer.data.examples[0].views[v].attention"
                ".map(l => l.map(h => h.map(r => Array.from(r))))",
                view,
            )
        )

    def check_clean(self) -> None:
        """No error in any frame, and no request but the notebook page itself."""
        assert self.errors == []
        assert self.requests == [self.file.as_uri()]
        self.context.close()


def query_tokens(frame) -> list[str]:
    return frame.eval_on_selector_all("#head-svg text.query", "ts => ts.map(t => t.textContent)")


def first_panel(frame) -> str:
    return frame.eval_on_selector("main > section", "el => el.id")


def test_two_views_draw_in_their_own_frames(browser, tmp_path):
    attention = random_attention(3, 4, 7, 7, seed=7)
    views = [head_view(attention, TOKENS, layer=1), model_view(random_attention(2, 2, 5, 5, seed=8), TOKENS[:5])]
    nb = NotebookPage(browser, [v._repr_html_() for v in views], tmp_path)
    one, two = nb.frames
    assert query_tokens(one) == TOKENS and query_tokens(two) == TOKENS[:5]
    assert one.locator("#head-svg line").count() > 0 and one.locator("#model-grid canvas").count() == 3 * 4
    assert two.locator("#model-grid canvas").count() == 2 * 2
    assert (first_panel(one), first_panel(two)) == ("head-view", "model-view")
    assert one.input_value("#layer-select") == "1" and two.input_value("#layer-select") == "0"
    expected = torch.cat(attention).double().numpy()
    np.testing.assert_allclose(nb.held(one), expected, atol=SMALL, rtol=0)
    # another layer in one frame leaves the other as it was
    renders = int(two.evaluate("document.body.dataset.renders"))
    two.select_option("#layer-select", "1")
    two.wait_for_function("n => Number(document.body.dataset.renders) > n", arg=renders)
    assert one.input_value("#layer-select") == "1" and one.evaluate("window.qkvExplorer.state.layer") == 1
    # docs/explorer_notebook.png when QKV_SCREENSHOT_DIR is set: the two outputs, as a notebook shows them
    folder = os.environ.get("QKV_SCREENSHOT_DIR")
    if folder:
        nb.page.screenshot(path=os.path.join(folder, "explorer_notebook.png"), full_page=True)
    nb.check_clean()


@pytest.mark.slow  # a Jupyter kernel that loads torch and MiniLM, and transformers for the reference: ~25 s idle
def test_notebook_kernel_outputs_draw_in_chromium(browser, minilm_explorer, tmp_path):
    outputs = executed_notebook(tmp_path)
    assert len(outputs) == 4  # show twice, head_view, model_view
    nb = NotebookPage(browser, outputs, tmp_path)
    frames = nb.frames
    assert len(frames) == 4
    boxes = [box.bounding_box() for box in nb.page.query_selector_all("div.qkv-explorer")]
    assert round(boxes[1]["height"]) == 520 + 2 and all(b["height"] > 300 for b in boxes)  # + its 1px border
    for frame, (tokens, reference) in zip(frames, transformers_weights(SENTENCES)):
        assert query_tokens(frame) == tokens
        assert frame.locator("#head-svg line").count() > 0
        assert frame.locator("#model-grid canvas").count() == 6 * 12
        held = nb.held(frame)
        assert held.shape == reference.shape
        np.testing.assert_allclose(held, reference, atol=SMALL, rtol=0)
        assert np.abs(held - reference)[reference >= 0.01].max() <= EXACT + 1e-5  # qkv vs transformers: ~4e-6
    # head_view opened on layer 2; model_view with the model view above the head view
    assert frames[2].input_value("#layer-select") == "2" and frames[0].input_value("#layer-select") == "0"
    assert [first_panel(f) for f in frames] == ["head-view", "head-view", "head-view", "model-view"]
    # each frame has its own state: another layer in the first leaves the second as it was
    renders = int(frames[0].evaluate("document.body.dataset.renders"))
    frames[0].select_option("#layer-select", "4")
    frames[0].wait_for_function("n => Number(document.body.dataset.renders) > n", arg=renders)
    assert frames[1].input_value("#layer-select") == "0" and frames[1].evaluate("window.qkvExplorer.state.layer") == 0
    nb.check_clean()
