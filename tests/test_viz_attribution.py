"""Attribution of generated tokens (qkv.viz.attribution), checked against computations written here:
for a language model, a small random GPT-2 (save_pretrained, loaded through qkv.load_pretrained)
against transformers' GPT2LMHeadModel: its own greedy continuation, gradient x input by autograd
through its inputs_embeds, and attention rollout by numpy from its output_attentions; for a
translation model, gradient x input against central finite differences in float64 and rollout by
numpy from the model's attention weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_viz_lens import TEXT, WordTokenizer, gpt2  # noqa: F401  (gpt2: a fixture)

from qkv import Transformer, TransformerConfig
from qkv.viz import Seq2SeqExplorer, check_data, explorer_data, write_html
from qkv.viz.attribution import NEW_TOKENS

transformers = pytest.importorskip("transformers")


def numpy_rollout(layers: list[np.ndarray]) -> np.ndarray:
    """Abnar & Zuidema's rollout through every layer: mean over heads, plus the identity, rows
    renormalised, multiplied from the first layer up. Each layer ``(h, s, s)``."""
    flow = np.eye(layers[0].shape[-1])
    for att in layers:
        mixed = att.mean(axis=0) + np.eye(att.shape[-1])
        flow = (mixed / mixed.sum(axis=1, keepdims=True)) @ flow
    return flow


def test_gpt2_continuation_attribution_against_transformers(gpt2):  # noqa: F811
    hf, model, explorer = gpt2
    prompt = model.tokenizer.encode(TEXT)
    s = len(prompt)
    example = explorer.example(TEXT)
    a = example["attribution"]
    # transformers' own greedy continuation
    full = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            full.append(int(hf(torch.tensor([full])).logits[0, -1].argmax()))
    generated = full[s:]
    assert a["prompt"] == explorer._labels(prompt) and a["generated"] == explorer._labels(generated)
    assert [step["context"] for step in a["steps"]] == [s + t for t in range(NEW_TOKENS)]
    # gradient x input: the token embeddings (wte rows) as the leaf, GPT-2 adding its positions itself
    inputs = torch.tensor([full[:-1]])
    embeddings = hf.transformer.wte(inputs).detach().requires_grad_(True)
    out = hf(inputs_embeds=embeddings, output_attentions=True)
    log_probs = torch.log_softmax(out.logits[0].double(), dim=-1)
    flow = numpy_rollout([layer[0].detach().double().numpy() for layer in out.attentions])
    for t, step in enumerate(a["steps"]):
        chosen = log_probs[s - 1 + t, generated[t]]
        (grad,) = torch.autograd.grad(chosen, embeddings, retain_graph=True)
        want = (grad * embeddings).sum(-1)[0, : s + t]
        assert torch.all(want[s + t :] == 0)  # (nothing after the position that chose it)
        assert step["scores"] == pytest.approx(want.tolist(), rel=2e-3, abs=1e-6), t
        assert step["prob"] == pytest.approx(float(chosen.detach().exp()), rel=1e-3)
        assert step["rollout"] == pytest.approx(flow[s - 1 + t, : s + t].tolist(), rel=1e-3, abs=1e-6), t
        assert sum(step["rollout"]) == pytest.approx(1.0, abs=1e-3)


def test_a_prompt_that_fills_the_context_gets_no_attribution(gpt2):  # noqa: F811
    _, model, explorer = gpt2
    text = TEXT * 8
    assert len(model.tokenizer.encode(text)) > model.config.context
    example = explorer.example(text)
    assert "attribution" not in example and len(example["lens"]["positions"]) == model.config.context


@pytest.fixture(scope="module")
def translator():
    torch.manual_seed(3)
    config = TransformerConfig(
        src_vocab_size=15, tgt_vocab_size=15, d_model=32, num_heads=4, num_encoder_layers=2,
        num_decoder_layers=2, d_ff=64, max_len=32, dropout=0.0,
    )  # fmt: skip
    tokenizer = WordTokenizer(["a", "dog", "runs", "on", "the", "beach", "ein", "hund", "läuft", "am", "strand"])
    model = Transformer(config).eval().double()
    return Seq2SeqExplorer(model=model, tokenizer=tokenizer, name="tiny-translator", max_new_tokens=5)


def log_prob(model, src, tgt_in, position, token, scale_row=None, alpha=1.0):
    """log p(token) at decoder ``position``, the source embedding of row ``scale_row`` times ``alpha``."""

    def scale(module, args, output):
        if scale_row is None:
            return output
        factor = torch.ones_like(output)
        factor[:, scale_row] = alpha
        return output * factor

    handle = model.src_embed.embedding.register_forward_hook(scale)
    try:
        with torch.no_grad():
            logits = model(src, tgt_in)[0, position]
    finally:
        handle.remove()
    return float(torch.log_softmax(logits, dim=-1)[token])


def test_translation_attribution_against_finite_differences_and_numpy_rollout(translator):
    model, tok = translator.model, translator.tokenizer
    text = "a dog runs on the beach"
    example = translator.example(text, "ein hund läuft am strand")
    check_data(explorer_data([example]))
    a = example["attribution"]
    src = torch.tensor([tok.encode(text, add_eos=True)])
    target = tok.encode("ein hund läuft am strand")
    tgt_in = torch.tensor([[tok.bos_id, *target]])
    predicted = [*target, tok.eos_id]
    assert a["prompt"] == example["views"][0]["keys"] and a["generated"] == example["views"][2]["queries"]
    assert len(a["steps"]) == len(predicted)
    with torch.no_grad():
        memory = model.encode(src, need_weights=True)
        cross = model.decode(tgt_in, memory, need_weights=True).cross_attentions
    encoder_flow = numpy_rollout([w[0].numpy() for w in memory.attentions])
    last_cross = cross[-1][0].numpy().mean(axis=0)  # (s_t, s_src)
    last_cross = last_cross / last_cross.sum(axis=1, keepdims=True)
    flow = last_cross @ encoder_flow
    h = 1e-5
    for t, step in enumerate(a["steps"]):
        assert step["context"] == src.size(1)
        want = [
            (
                log_prob(model, src, tgt_in, t, predicted[t], j, 1 + h)
                - log_prob(model, src, tgt_in, t, predicted[t], j, 1 - h)
            )
            / (2 * h)
            for j in range(src.size(1))
        ]
        assert step["scores"] == pytest.approx(want, rel=2e-3, abs=1e-6), t
        assert step["prob"] == pytest.approx(np.exp(log_prob(model, src, tgt_in, t, predicted[t])), rel=1e-3)
        assert step["rollout"] == pytest.approx(flow[t].tolist(), rel=1e-3, abs=1e-6), t


def test_bad_attribution_fields_are_refused(translator):
    data = explorer_data([translator.example("a dog runs")])
    for change, message in [
        (lambda x: x.pop("steps"), "has no 'steps'"),
        (lambda x: x["generated"].append("extra"), "'steps' must be a list of"),
        (lambda x: x["steps"][0].__setitem__("context", 99), "step 0: 'context' must be"),
        (lambda x: x["steps"][0]["scores"].pop(), "step 0: 'scores' must be"),
        (lambda x: x["steps"][0]["rollout"].__setitem__(0, -0.5), "step 0: 'rollout' must be"),
        (lambda x: x["steps"][0].__setitem__("prob", 2.0), "step 0: 'prob' must be"),
        (lambda x: x.__setitem__("prompt", [1, 2]), "'prompt' must be a list of strings"),
    ]:
        bad = copy.deepcopy(data)
        change(bad["examples"][0]["attribution"])
        with pytest.raises(ValueError, match=f"example 0 'attribution': {message}"):
            check_data(bad)


# ---- the page ------------------------------------------------------------------------------------

POSITIVE, NEGATIVE = "#d9480f", "#1c7ed6"
LONG_TEXT = "The quick brown fox jumps over the lazy dog. The dog sleeps, the fox runs."


def js_prob(p: float) -> str:
    """What lens.js's Q.formatProb writes for a probability of at least 0.001."""
    return f"{p:.3f}"


def open_tab(page, tab: str) -> None:
    from test_browser import wait_renders

    before = int(page.evaluate("Number(document.body.dataset.renders)"))
    page.click(f"#tabs button[data-tab='{tab}']")
    wait_renders(page, before)


def click(page, selector: str) -> None:
    from test_browser import wait_renders

    before = int(page.evaluate("Number(document.body.dataset.renders)"))
    page.click(selector)
    wait_renders(page, before)


def lens_cells(page) -> dict[tuple[int, int], tuple[str, float, str]]:
    rows = page.eval_on_selector_all(
        "#lens-svg rect.lens-cell",
        "rs => rs.map(r => [+r.dataset.layer, +r.dataset.position, r.dataset.token, +r.getAttribute('fill-opacity'),"
        " r.dataset.match])",
    )
    return {(layer, i): (token, opacity, match) for layer, i, token, opacity, match in rows}


def check_bars(page, kind: str, lens: dict, layer: int, position: int) -> None:
    bars = page.eval_on_selector_all(
        f"#lens-svg rect.{kind}", "rs => rs.map(r => [r.dataset.token, +r.dataset.prob, +r.getAttribute('width')])"
    )
    values = page.eval_on_selector_all(f"#lens-svg text.{kind}-value", "ts => ts.map(t => t.textContent)")
    want = [(lens["vocabulary"][n], p) for n, p in zip(lens["top"][layer][position], lens["probs"][layer][position])]
    assert [(token, p) for token, p, _ in bars] == want
    assert [w for _, _, w in bars] == pytest.approx([max(1.0, 220 * p) for _, p in want], abs=0.01)
    assert values == [js_prob(p) if p >= 0.001 else values[i] for i, (_, p) in enumerate(want)]


def test_lens_and_attribution_views_draw_the_documents_numbers(gpt2, translator, tmp_path):  # noqa: F811
    from chromium import chromium
    from test_browser import Watch, offline_page, wait_renders
    from test_browser_analysis import screenshot  # saves docs/explorer_*.png when QKV_SCREENSHOT_DIR is set

    _, _, explorer = gpt2
    lm, mt = explorer.example(LONG_TEXT), translator.example("a dog runs on the beach")
    html = write_html(explorer_data([lm, mt]), tmp_path / "views.html")
    with chromium() as browser:
        blocked: list[str] = []
        context, page = offline_page(browser, blocked)
        watch = Watch(page)
        page.goto(html.as_uri())
        wait_renders(page, 0)
        # the logit lens opens on the last position at the model's output
        open_tab(page, "lens")
        lens = lm["lens"]
        s, depth = len(lens["positions"]), len(lens["layers"])
        assert s > 16 and page.is_visible("#lens-window")
        start = (s - 1) // 16 * 16
        cells = lens_cells(page)
        assert set(cells) == {(layer, i) for layer in range(depth) for i in range(start, s)}
        for (layer, i), (token, opacity, match) in cells.items():
            top = lens["vocabulary"][lens["top"][layer][i][0]]
            assert token == top and opacity == pytest.approx(lens["probs"][layer][i][0], abs=1e-3)
            assert match == ("1" if top == lens["next"][i] else "0")
        check_bars(page, "lens-bar", lens, depth - 1, s - 1)
        check_bars(page, "candidate-bar", lens, depth - 1, s - 1)
        assert page.locator("#lens-svg text.lens-bar-next").count() == 0  # nothing came after the text
        # the first window, then a cell of layer 0: its tokens beside the candidates at that position
        before = int(page.evaluate("Number(document.body.dataset.renders)"))
        page.select_option("#lens-window", "0")
        wait_renders(page, before)
        assert {i for _, i in lens_cells(page)} == set(range(16))
        heads = page.eval_on_selector_all("#lens-svg text.lens-position", "ts => ts.map(t => t.textContent)")
        assert heads == [t if len(t) < 8 else heads[i] for i, t in enumerate(lens["positions"][:16])]
        click(page, "#lens-svg rect.lens-cell[data-layer='1'][data-position='3']")
        check_bars(page, "lens-bar", lens, 1, 3)
        check_bars(page, "candidate-bar", lens, depth - 1, 3)
        assert page.text_content("#lens-svg text.lens-bar-next") == (
            f"came next: {lens['next'][3]} {js_prob(lens['next_probs'][1][3])}"
        )
        screenshot(page, "explorer_lens.png")
        # attribution: a chip per generated token; a step's chips shaded by its scores and rollout
        open_tab(page, "attribution")
        a = lm["attribution"]
        chips = page.eval_on_selector_all("#attribution-steps .step-chip", "bs => bs.map(b => b.textContent)")
        assert chips == a["generated"]
        for t in (2, 0):
            click(page, f"#attribution-steps .step-chip[data-index='{t}']")
            step = a["steps"][t]
            scores = page.eval_on_selector_all(
                "#attribution-svg rect.score",
                "rs => rs.map(r => [r.getAttribute('fill'), +r.getAttribute('fill-opacity'), r.classList.contains('generated')])",
            )
            top = max(abs(v) for v in step["scores"])
            assert len(scores) == step["context"]
            for (fill, opacity, generated), v, i in zip(scores, step["scores"], range(step["context"])):
                assert fill == (POSITIVE if v >= 0 else NEGATIVE) and opacity == pytest.approx(abs(v) / top, abs=1e-3)
                assert generated == (i >= len(a["prompt"]))
            shades = page.eval_on_selector_all(
                "#attribution-svg rect.rollout", "rs => rs.map(r => +r.getAttribute('fill-opacity'))"
            )
            assert shades == pytest.approx([w / max(step["rollout"]) for w in step["rollout"]], abs=1e-3)
            assert f"p = {js_prob(step['prob'])}" in page.text_content("#attribution-svg")
        screenshot(page, "explorer_attribution.png")
        # the translation: its decoder's lens and each target token over the source
        before = int(page.evaluate("Number(document.body.dataset.renders)"))
        page.select_option("#example-select", "1")
        wait_renders(page, before)
        chips = page.eval_on_selector_all("#attribution-steps .step-chip", "bs => bs.map(b => b.textContent)")
        assert chips == mt["attribution"]["generated"]
        assert page.locator("#attribution-svg rect.score").count() == len(mt["attribution"]["prompt"])
        open_tab(page, "lens")
        assert len(lens_cells(page)) == len(mt["lens"]["layers"]) * len(mt["lens"]["positions"])
        assert not page.is_visible("#lens-window")
        assert page.evaluate("() => window.qkvExplorer.tab('lens').figures.lens().height > 0")
        assert watch.errors == []
        assert blocked == [] and all(url.startswith(("file:", "blob:")) for url in watch.requests)
        context.close()
