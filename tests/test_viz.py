"""The explorer's data: exact weights on the fast path, views of encoders and seq2seq models,
the self-contained HTML, PNG heatmaps and the ``qkv attend`` command."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from test_viz_page import assert_page_holds

import qkv
from qkv import Transformer, TransformerConfig
from qkv.cli import main
from qkv.viz import (
    AttentionRecorder,
    AttentionView,
    EncoderExplorer,
    Seq2SeqExplorer,
    check_data,
    explorer_data,
    make_example,
    render_html,
)
from qkv.viz.html import page_document

SENTENCE = "time flies like an arrow"


class WordTokenizer:
    """A whitespace tokenizer with qkv's special ids (pad 0, bos 1, eos 2, unk 3)."""

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, words: list[str]) -> None:
        self.words = ["<pad>", "<s>", "</s>", "<unk>", *words]
        self.index = {w: i for i, w in enumerate(self.words)}

    def encode(self, text, *, add_bos=False, add_eos=False):
        ids = [self.index.get(w, self.unk_id) for w in text.split()]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids):
        return " ".join(self.words[int(i)] for i in ids if int(i) > 3)


@pytest.fixture(scope="module")
def tiny_seq2seq():
    tokenizer = WordTokenizer(["a", "dog", "runs", "on", "the", "beach", "ein", "hund", "läuft", "am", "strand"])
    torch.manual_seed(3)
    config = TransformerConfig(
        src_vocab_size=15,
        tgt_vocab_size=15,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=3,
        d_ff=64,
        max_len=32,
        dropout=0.0,
    )
    return Transformer(config).eval(), tokenizer


@pytest.fixture(scope="module")
def minilm():
    from qkv.pretrained import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return qkv.load_pretrained(path, device="cpu")


def make_tiny_bert(folder):
    transformers = pytest.importorskip("transformers")
    words = ["the", "a", "dog", "cat", "runs", "sleeps", "on", "mat", "beach", "time", "flies", "like", "an", "arrow"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    config = transformers.BertConfig(
        vocab_size=len(words) + 5,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        initializer_range=0.3,
    )
    torch.manual_seed(2)
    transformers.BertModel(config).save_pretrained(str(folder))
    return folder


# ---- item 5: the weights of a fast forward pass, recomputed exactly --------------------------


def test_recorder_on_bert_equals_eager_path(minilm, caplog):
    batch = minilm.tokenizer([SENTENCE, "fruit flies like a banana, they say"])
    args = (batch.input_ids, batch.attention_mask, batch.token_type_ids)
    modules = {str(i): layer.self_attn for i, layer in enumerate(minilm.layers)}
    with torch.no_grad():
        plain = minilm(*args).last_hidden_state
        with caplog.at_level(logging.DEBUG, logger="qkv.attention.backends"):
            with AttentionRecorder(modules) as recorder:
                recorded = minilm(*args).last_hidden_state
            assert not [r for r in caplog.records if "fell back" in r.getMessage()]  # the fused path ran
            weights = recorder.weights()
        eager = minilm(*args, output_attentions=True)
    assert torch.equal(recorded, plain)  # recording does not change the forward pass
    assert (eager.last_hidden_state - recorded).abs().max() <= 1e-5
    # layer 0 sees identical inputs on both paths, so its weights are bit-for-bit the eager ones
    assert torch.equal(weights["0"][0], eager.attentions[0])
    for i, eager_weights in enumerate(eager.attentions):
        assert len(weights[str(i)]) == 1
        # later layers' inputs differ by float rounding between the fused and eager kernels
        assert (weights[str(i)][0] - eager_weights).abs().max() <= 1e-5
    # given the same inputs (every layer on the reference path), the recomputation is bit-exact
    with torch.no_grad(), qkv.use_backend("reference"):
        with AttentionRecorder(modules) as recorder:
            minilm(*args)
        for i, w in enumerate(eager.attentions):
            assert torch.equal(recorder.weights()[str(i)][0], w)


def test_recorder_on_transformer_equals_eager_path(tiny_seq2seq):
    model, _ = tiny_seq2seq
    src = torch.tensor([[4, 5, 6, 7, 2, 0], [8, 9, 2, 0, 0, 0]])  # padded sources
    tgt = torch.tensor([[1, 10, 11, 12], [1, 13, 14, 0]])
    enc, dec = model.encoder.layers, model.decoder.layers
    modules = {f"enc{i}": layer.self_attn for i, layer in enumerate(enc)}
    modules |= {f"dec{i}": layer.self_attn for i, layer in enumerate(dec)}
    modules |= {f"cross{i}": layer.cross_attn for i, layer in enumerate(dec)}
    with torch.no_grad():
        with AttentionRecorder(modules) as recorder:
            logits = model.decode(tgt, model.encode(src)).logits
        got = recorder.weights()
        memory = model.encode(src, need_weights=True)
        eager = model.decode(tgt, memory, need_weights=True)
    assert (logits - eager.logits).abs().max() <= 1e-5
    pairs = [(f"enc{i}", w) for i, w in enumerate(memory.attentions)]
    pairs += [(f"dec{i}", w) for i, w in enumerate(eager.self_attentions)]
    pairs += [(f"cross{i}", w) for i, w in enumerate(eager.cross_attentions)]
    for name, want in pairs:
        assert (got[name][0] - want).abs().max() <= 1e-6, name
    assert torch.equal(got["enc0"][0], memory.attentions[0])
    assert got["cross0"][0][1, :, :, 3:].abs().max() == 0  # padded source keys get no weight


def test_recorder_rejects_other_modules():
    with pytest.raises(ValueError, match="not a qkv MultiHeadAttention"):
        AttentionRecorder({"x": torch.nn.MultiheadAttention(8, 2)})


# ---- views ------------------------------------------------------------------------------------


def test_encoder_explorer_weights_match_transformers(minilm):
    transformers = pytest.importorskip("transformers")
    from qkv.pretrained import default_model_path

    example = EncoderExplorer(model=minilm, name="all-MiniLM-L6-v2").example(SENTENCE)
    (view,) = example["views"]
    assert view["queries"] == view["keys"] == ["[CLS]", "time", "flies", "like", "an", "arrow", "[SEP]"]
    assert (view["layers"], view["heads"]) == (6, 12)
    hf = transformers.BertModel.from_pretrained(str(default_model_path()), attn_implementation="eager").eval()
    batch = minilm.tokenizer([SENTENCE])
    with torch.no_grad():
        want = hf(input_ids=batch.input_ids, output_attentions=True).attentions
    got = torch.tensor(view["attention"])  # (layers, heads, s, s), rounded to 4 decimals
    assert (got - torch.stack([w[0] for w in want])).abs().max() <= 5e-5 + 1e-5


def test_seq2seq_explorer_views(tiny_seq2seq):
    model, tokenizer = tiny_seq2seq
    explorer = Seq2SeqExplorer(model=model, tokenizer=tokenizer, name="tiny", max_new_tokens=5)
    example = explorer.example("a dog runs")
    enc, dec, cross = example["views"]
    names = ["encoder self-attention", "decoder self-attention", "cross-attention"]
    assert [v["name"] for v in example["views"]] == names
    assert enc["queries"] == enc["keys"] == ["a", "dog", "runs", "</s>"]
    assert dec["queries"][0] == "<s>" and cross["keys"] == enc["keys"]
    assert cross["queries"] == dec["queries"][1:] + ["</s>"]  # rows: the token each position predicts
    assert (enc["layers"], dec["layers"], cross["layers"], cross["heads"]) == (2, 3, 3, 4)
    for view in example["views"]:
        rows = torch.tensor(view["attention"]).sum(-1)
        assert (rows - 1).abs().max() <= 1e-3  # rows sum to 1 (rounded to 4 decimals)
    causal = torch.tensor(dec["attention"])
    assert causal.triu(diagonal=1).abs().max() == 0  # no position attends to a later one
    # the shown translation is the model's greedy output: check against qkv's decoder
    decoding = pytest.importorskip("qkv.decoding.search")
    src = torch.tensor([tokenizer.encode("a dog runs", add_eos=True)])
    greedy = decoding.greedy_decode(model, src, bos_id=1, eos_id=2, extra_len=5, use_cache=False)[0]
    assert example["output"] == tokenizer.decode(greedy[:5])
    forced = explorer.example("a dog runs", target="ein hund")
    assert forced["views"][1]["queries"] == ["<s>", "ein", "hund"] and forced["output"] == "ein hund"
    assert forced["views"][2]["queries"] == ["ein", "hund", "</s>"]


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert message and "\n" not in message
    return message


def test_tokens_versus_attention_mismatch_is_a_one_line_error():
    with pytest.raises(ValueError) as err:
        AttentionView("self-attention", ["a", "b"], ["a", "b"], [torch.rand(4, 3, 3)])
    assert "(4, 3, 3)" in one_line(err) and "2 query tokens and 2 key tokens" in one_line(err)
    with pytest.raises(ValueError) as err:
        AttentionView("x", ["a"], ["a", "b"], [torch.rand(2, 1, 2), torch.rand(3, 1, 2)])
    assert "layer 1 has 3 heads" in one_line(err)
    with pytest.raises(ValueError) as err:
        AttentionView("x", ["a"], ["a"], [torch.rand(2, 2, 1, 1)])  # a batch of 2 is not one input
    one_line(err)
    data = explorer_data([make_example("a b", [AttentionView("x", ["a", "b"], ["a", "b"], [torch.rand(2, 2, 2)])])])
    data["examples"][0]["views"][0]["keys"].append("c")  # a document edited by hand
    with pytest.raises(ValueError) as err:
        check_data(data)
    assert "2 query and 3 key tokens" in one_line(err)


def test_html_is_self_contained_and_escapes_text():
    hostile = "</script><script>alert(1)</script> & \u2028"
    view = AttentionView("self-attention", [hostile, "b"], [hostile, "b"], [torch.softmax(torch.rand(2, 2, 2), -1)])
    data = explorer_data([make_example(hostile, [view], model="m")])
    page = render_html(data)
    assert page.count("</script>") == 2  # the data element's and the code's own closing tags only
    assert "alert(1)</script>" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing to fetch
    assert "<link" not in page and "@import" not in page
    assert "default-src 'none'" in page
    # the data survives escaping intact (weights of two keys are >= 0.01: the page keeps them exactly)
    assert page_document(page) == json.loads(json.dumps(data))


# ---- qkv attend ---------------------------------------------------------------------------


def test_attend_cli_writes_html_json_and_png(tmp_path, capsys):
    model_dir = make_tiny_bert(tmp_path / "tiny-bert")
    html, data_path, png_dir = tmp_path / "out.html", tmp_path / "out.json", tmp_path / "png"
    code = main(
        [
            "attend",
            "the dog runs",
            "a cat sleeps",
            "--model",
            str(model_dir),
            "-o",
            str(html),
            "--json",
            str(data_path),
            "--png",
            str(png_dir),
        ]
    )
    assert code == 0
    data = json.loads(data_path.read_text())
    check_data(data)
    assert [e["text"] for e in data["examples"]] == ["the dog runs", "a cat sleeps"]
    assert data["examples"][0]["views"][0]["queries"] == ["[CLS]", "the", "dog", "runs", "[SEP]"]
    # the page holds the same document; its weights below 0.01 rounded to within 0.0002 (qkv.viz.html.pack_weights)
    assert_page_holds(page_document(html.read_text()), data)
    pngs = sorted(png_dir.glob("*.png"))
    assert len(pngs) == 2 * 3  # 2 sentences x 3 layers
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert sorted(png_dir.iterdir()) == pngs  # no temporary file left behind


def test_attend_cli_on_a_translation_run_folder(tmp_path, tiny_seq2seq):
    checkpoint = pytest.importorskip("qkv.training.checkpoint_files")
    folder = pytest.importorskip("qkv.runs.folder")
    data = pytest.importorskip("qkv.data.tokenizer")
    model, _ = tiny_seq2seq
    tokenizer = data.Tokenizer.train(["a dog runs on the beach", "ein hund läuft am strand"] * 5, vocab_size=300)
    config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        max_len=32,
        share_embeddings=True,
    )
    run = folder.create_run(tmp_path / "run", {"model": config.__dict__}, tokenizer)
    checkpoint.save_weights(Transformer(config), run / "model.safetensors")
    html = tmp_path / "t.html"
    assert main(["attend", "a dog runs", "--model", str(run), "-o", str(html)]) == 0
    blob = html.read_text().split('type="application/json">', 1)[1].split("</script>", 1)[0]
    views = json.loads(blob)["examples"][0]["views"]
    assert [v["name"] for v in views] == ["encoder self-attention", "decoder self-attention", "cross-attention"]
    assert views[0]["queries"][-1] == "</s>" and views[2]["keys"] == views[0]["queries"]


def test_attend_cli_errors_are_one_line(tmp_path, capsys):
    model_dir = make_tiny_bert(tmp_path / "tiny-bert")
    capsys.readouterr()
    for argv in (
        ["attend", "x", "--model", str(tmp_path / "nowhere")],
        ["attend", "x" * 50, "--max-chars", "10"],
        ["attend", "the dog", "--model", str(model_dir), "--target", "a"],
        ["attend", "   ", "--model", str(model_dir)],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("qkv attend: error:") and "\n" not in err, err
