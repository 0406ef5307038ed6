"""The attention explorer on language models: a qkv LM run folder (and a GPT-2 folder) opened by
``open_explorer``, every layer's and head's causal self-attention checked against a softmax of
the layer's own query/key projections computed here, readable token labels, and ``qkv attend`` /
``qkv serve`` on such a folder."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from test_viz_page import assert_page_holds

from qkv.cli import main
from qkv.data.spec import DataSpec
from qkv.data.text import CharTokenizer
from qkv.runs.folder import load_run
from qkv.runs.translation import run_training, start_run
from qkv.viz import CausalLMExplorer, check_data, explorer_data, open_explorer
from qkv.viz.html import page_document
from qkv.viz.lm_explorer import BYTE_ALPHABET, lm_token_labels, visible

# the GPT-2 layout (the language-model recipe's before 2.0), which independent_attention writes out
MODEL = dict(d_model=32, num_heads=4, num_layers=2, d_ff=64, context=24, dropout=0.0)
MODEL.update(positional="learned", norm="layer", activation="gelu_tanh", bias=True)
TRAIN = dict(max_steps=3, max_minutes=0, progress=False, max_tokens=128, warmup_steps=2)
TEXT = "".join(f"{'to be or not to be' if i % 2 else 'that is the question'}, line {i % 7}.\n" for i in range(60))
TEXT_CHARS = sorted(set(TEXT))


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm")
    (folder / "train.txt").write_text(TEXT, encoding="utf-8")
    torch.manual_seed(0)
    trainer = start_run(
        folder / "run",
        data=DataSpec(source="text", train_text=str(folder / "train.txt")),
        model_options=MODEL,
        train_options=TRAIN,
        device="cpu",
    )
    run_training(trainer)
    return folder / "run"


@pytest.fixture(scope="module")
def explorer(lm_run):
    explorer = open_explorer(lm_run)
    explorer.model.cpu()
    return explorer


def independent_attention(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's causal attention weights from its own q/k projections: the layer's input (taken
    with a pre-hook on the block, nothing else of qkv's attention code), LayerNorm when pre-LN,
    ``softmax(q k^T / sqrt(d_head))`` with the keys after each query set to -inf. Per layer
    ``(h, s, s)``."""
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for layer in model.decoder.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    h, s = model.config.num_heads, ids.size(1)
    d_head = model.config.d_model // h
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    out = []
    with torch.no_grad():
        for layer, x in zip(model.decoder.layers, inputs):
            x = layer.norm1(x) if layer.norm_first else x
            q = layer.self_attn.q_proj(x)[0].view(s, h, d_head).transpose(0, 1).double()  # (h, s, d_head)
            k = layer.self_attn.k_proj(x)[0].view(s, h, d_head).transpose(0, 1).double()
            scores = (q @ k.transpose(1, 2)) / math.sqrt(d_head)  # (h, s, s)
            out.append(torch.softmax(scores.masked_fill(future, -math.inf), dim=-1).float())
    return out


def check_causal_view(example: dict, model, ids: list[int]) -> torch.Tensor:
    (view,) = example["views"]
    assert view["name"] == "causal self-attention"
    cfg = model.config
    assert (view["layers"], view["heads"]) == (cfg.num_layers, cfg.num_heads)
    assert len(view["queries"]) == len(view["keys"]) == len(ids)
    got = torch.tensor(view["attention"])  # (layers, heads, s, s), rounded to 4 decimals
    x = torch.tensor([ids])
    with torch.no_grad():
        own = torch.stack([w[0] for w in model(x, need_weights=True).attentions])
    want = torch.stack(independent_attention(model, x))
    assert (own - want).abs().max() <= 1e-5  # the model's own weights are the softmax computed here
    assert (got - want).abs().max() <= 5e-5 + 1e-6  # every layer and head, to the 4 decimals stored
    assert got.triu(diagonal=1).abs().max() == 0  # nothing above the diagonal: no token sees a later one
    assert got[:, :, 0, 0].eq(1).all()  # the first token can only attend to itself
    assert (got.sum(-1) - 1).abs().max() <= 1e-3  # rows sum to 1
    return got


def test_open_explorer_recognises_a_language_model_run(lm_run, explorer):
    assert isinstance(explorer, CausalLMExplorer) and explorer.kind == "lm" and explorer.name == "run"
    assert explorer.sample_text and explorer.encodes(explorer.sample_text)
    assert explorer.sample_text in TEXT


def test_every_layer_and_head_is_the_causal_softmax(explorer):
    text = "the question,\nto be"  # 19 characters, within the context of 24
    example = explorer.example(text)
    ids = [TEXT_CHARS.index(c) for c in text]
    check_causal_view(example, explorer.model, ids)
    (view,) = example["views"]
    assert view["queries"] == view["keys"] == [visible(c) for c in text]
    assert view["queries"][3] == "\u2423" and view["queries"][13] == "\u23ce"  # ␣ and ⏎, never invisible
    assert example["text"] == text and example["model"] == "run"
    # the output names the model's most likely next token
    with torch.no_grad():
        logits = explorer.model(torch.tensor([ids])).logits[0, -1]
    best = visible(TEXT_CHARS[int(logits.argmax())])
    assert example["output"].startswith(f"most likely next token: {best} (p = ")
    check_data(explorer_data([example]))


def test_a_long_text_is_cropped_from_the_left(explorer):
    text = TEXT[:40]  # 40 characters, context 24
    example = explorer.example(text)
    ids = [TEXT_CHARS.index(c) for c in text[-24:]]
    check_causal_view(example, explorer.model, ids)
    assert example["views"][0]["queries"] == [visible(c) for c in text[-24:]]
    assert "showing its last 24 of 40 tokens" in example["output"]


def test_bad_text_is_a_one_line_value_error(explorer):
    for text, words in (("to be or NOT", "not in the model's vocabulary"), ("", "empty"), ("  \n", "empty")):
        with pytest.raises(ValueError) as err:
            explorer.example(text)
        message = str(err.value)
        assert words in message and "\n" not in message, message
    assert not explorer.encodes("to be or NOT") and explorer.encodes("to be")


def unlabel(labels: list[str]) -> str:
    """The text a row of labels stands for: markers back to whitespace, ``\\xNN`` back to bytes."""
    marks = {"\u2423": " ", "\u23ce": "\n", "\u21e5": "\t"}
    raw = b""
    for m in re.finditer(r"\\x([0-9a-f]{2})|(.)", "".join(labels), flags=re.S):
        raw += bytes([int(m.group(1), 16)]) if m.group(1) else marks.get(m.group(2), m.group(2)).encode()
    return raw.decode("utf-8")


def test_token_labels():
    tokenizers = pytest.importorskip("tokenizers")
    assert set(BYTE_ALPHABET) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_ALPHABET.values()) == list(range(256)) and BYTE_ALPHABET["\u0120"] == ord(" ")  # Ġ
    from qkv.data.tokenizer import Tokenizer

    bpe = Tokenizer.train(["the cat sat on the mat\n", "the café\tis naïve 😀\n"] * 20, vocab_size=300)
    for text in ("the cat\n\tsat 😀", "😀", "zq😀€ naïve"):
        labels = lm_token_labels(bpe, bpe.encode(text))
        assert all(label and not any(c.isspace() for c in label) for label in labels), labels
        assert unlabel(labels) == text  # nothing lost: each label is exactly its token's bytes
    labels = lm_token_labels(bpe, bpe.encode("the cat\n\tsat"))
    assert "\u2423cat" in labels and "\u23ce" in labels and "\u21e5" in labels  # Ġcat -> ␣cat
    assert "\\x" in "".join(lm_token_labels(bpe, bpe.encode("€")))  # bytes of a split character
    chars = CharTokenizer("ab \n")
    assert lm_token_labels(chars, chars.encode("a b\n")) == ["a", "\u2423", "b", "\u23ce"]
    assert visible("a\x00b\u2028") == "a\\x00b\\u2028" and visible("") == "\u2205"


def test_attend_cli_on_a_language_model_run(lm_run, tmp_path, capsys):
    html, data_path = tmp_path / "lm.html", tmp_path / "lm.json"
    code = main(
        ["attend", "to be or not", "that is", "--model", str(lm_run), "-o", str(html), "--json", str(data_path)]
    )
    assert code == 0, capsys.readouterr().err
    data = json.loads(data_path.read_text())
    check_data(data)
    assert [e["text"] for e in data["examples"]] == ["to be or not", "that is"]
    assert_page_holds(page_document(html.read_text(encoding="utf-8")), data)  # the page carries the data
    model, _, _ = load_run(lm_run)
    check_causal_view(data["examples"][0], model, [TEXT_CHARS.index(c) for c in "to be or not"])
    assert "lm model run" in capsys.readouterr().err


def test_attend_cli_bad_input_exits_2_with_one_line(lm_run, tmp_path, capsys):
    for argv in (
        ["attend", "to be or NOT", "--model", str(lm_run), "-o", str(tmp_path / "a.html")],
        ["attend", "", "--model", str(lm_run), "-o", str(tmp_path / "b.html")],
        ["attend", "to be", "--model", str(lm_run), "--target", "x", "-o", str(tmp_path / "c.html")],
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("qkv attend: error:") and "\n" not in err, err
    assert not list(tmp_path.glob("*.html"))


def test_serve_draws_a_language_model_page(lm_run, explorer):
    from qkv.viz.app import ExplorerApp, RequestError

    app = ExplorerApp(explorers={"run": explorer}, max_chars=100, initial_text=explorer.sample_text)
    page = app.page()
    assert "causal self-attention" in page
    answer = app.attend({"text": "to be", "model": "run"})
    assert answer["example"]["views"][0]["queries"] == ["t", "o", "\u2423", "b", "e"]
    with pytest.raises(RequestError) as err:
        app.attend({"text": "TO BE"})
    assert err.value.status == 400 and "not in the model's vocabulary" in err.value.message


def test_gpt2_folder_opens_as_a_language_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("qkv.pretrained.gpt2")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["the cat sat on the mat.\n", "attention is all you need\n"] * 10, trainer)
    folder = tmp_path / "tiny-gpt2"
    config = transformers.GPT2Config(
        vocab_size=bpe.get_vocab_size(),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(folder))
    bpe.save(str(folder / "tokenizer.json"))

    explorer = open_explorer(folder)
    assert isinstance(explorer, CausalLMExplorer) and explorer.name == "tiny-gpt2"
    explorer.model.cpu()
    text = "the cat sat on the mat.\nattention"
    ids = bpe.encode(text).ids
    example = explorer.example(text)
    check_causal_view(example, explorer.model, ids)
    labels = example["views"][0]["queries"]
    assert labels[:3] == ["the", "\u2423cat", "\u2423sat"] and "\u23ce" in labels
    # longer than the 16 positions: the last 16 tokens are shown
    long_ids = bpe.encode(text * 3).ids
    check_causal_view(explorer.example(text * 3), explorer.model, long_ids[-16:])


def test_serve_command_opens_on_the_runs_own_text(lm_run, monkeypatch, capsys):
    """``qkv serve --model RUN``: the default sentence has characters this vocabulary lacks, so the
    page opens on the start of the run's own text instead of failing."""
    import qkv.serve.server as server

    apps = []

    class Stopped:
        server_address = ("127.0.0.1", 1)

        def serve_forever(self):
            raise KeyboardInterrupt

        def server_close(self):
            pass

    def fake_make_server(app, **limits):
        apps.append(app)
        return Stopped()

    monkeypatch.setattr(server, "make_server", fake_make_server)
    assert main(["serve", "--model", str(lm_run), "--port", "0"]) == 0
    (app,) = apps
    assert app.initial_text and app.initial_text in TEXT and "causal self-attention" in app.page()
    capsys.readouterr()
    assert main(["serve", "--model", str(lm_run), "--port", "0", "--text", "time flies"]) == 2  # asked for
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv serve: error:") and "not in the model's vocabulary" in err and "\n" not in err


def test_language_model_page_in_a_real_browser(explorer, tmp_path):
    from chromium import chromium

    from qkv.viz import write_html

    text = "to be or not"
    html = write_html(explorer_data([explorer.example(text)]), tmp_path / "lm.html")
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1320, "height": 900})
        context.set_offline(True)
        page = context.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        page.goto(html.as_uri())
        page.wait_for_function("Number(document.body.dataset.renders || 0) > 0")
        queries = page.eval_on_selector_all("#head-svg text.query", "ts => ts.map(t => t.textContent)")
        assert queries == [visible(c) for c in text]
        drawn = page.eval_on_selector_all("#head-svg line", "ls => ls.map(l => [+l.dataset.q, +l.dataset.k])")
        assert drawn and all(k <= q for q, k in drawn)  # every line goes to the token itself or an earlier one
        assert set(page.eval_on_selector_all("#head-svg line", "ls => ls.map(l => +l.dataset.head)")) == set(range(4))
        # the model view: one heatmap per layer and head, white above the diagonal
        cells = page.eval_on_selector_all(
            "#model-grid canvas",
            """cs => cs.map(c => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, n = c.width, above = [];
            for (let q = 0; q < c.height; q++) for (let k = q + 1; k < n; k++) above.push(d[4 * (q * n + k)]);
            return {layer: +c.dataset.layer, head: +c.dataset.head, above: above, first: d[0]};
        })""",
        )
        assert sorted((c["layer"], c["head"]) for c in cells) == [(layer, h) for layer in range(2) for h in range(4)]
        assert all(set(c["above"]) == {255} and c["first"] == 36 for c in cells)  # token 0 sees only itself
        assert errors == []
        context.close()
