"""The joint byte-level BPE tokenizer: exact round trip, special ids, save/load, digit splitting."""

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data.tokenizer import Tokenizer

CORPUS = [
    "Two young, White males are outside near many bushes.",
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "Several men in hard hats are operating a giant pulley system.",
    "Mehrere Männer mit Schutzhelmen bedienen ein Antriebsradsystem.",
    "A little girl climbing into a wooden playhouse.",
    "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(CORPUS, vocab_size=400, min_frequency=2)


def test_special_ids_and_vocab(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    backend = tokenizer.backend
    assert [backend.id_to_token(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert tokenizer.vocab_size <= 400
    assert tokenizer.encode("Männer", add_bos=True, add_eos=True)[0] == 1
    assert tokenizer.encode("Männer", add_bos=True, add_eos=True)[-1] == 2
    # frequent words become single tokens: BPE learned something
    assert len(tokenizer.encode(" Männer")) == 1


@pytest.mark.parametrize(
    "text",
    [
        "Zwei junge weiße Männer sind im Freien.",
        "  leading and trailing spaces  ",
        "tabs\tand\u00a0non-breaking spaces",
        "never seen: 日本語, emoji 🙂🐕, math ∑x², ÆØÅ",
        "a",
        "",
        "<s> </s> <pad> <unk>: text that spells the special tokens",
    ],
)
def test_round_trip_exact(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_id not in ids  # byte level: nothing is unknown


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_text(text):
    tok = _shared()
    assert tok.decode(tok.encode(text)) == text


_CACHE = {}


def _shared():
    if "tok" not in _CACHE:
        _CACHE["tok"] = Tokenizer.train(CORPUS, vocab_size=300)
    return _CACHE["tok"]


def test_decode_drops_specials_and_stops_at_eos(tokenizer):
    ids = tokenizer.encode("Ein Hund")
    assert tokenizer.decode([1] + ids + [2] + tokenizer.encode(" und mehr")) == "Ein Hund"
    assert tokenizer.decode([0, 0] + ids + [0]) == "Ein Hund"


def test_batch_matches_single(tokenizer):
    texts = CORPUS[:6]
    assert tokenizer.encode_batch(texts, add_eos=True) == [tokenizer.encode(t, add_eos=True) for t in texts]


def test_save_load_same_ids(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    assert json.loads(path.read_text())["model"]["type"] == "BPE"
    loaded = Tokenizer.load(path)
    for text in CORPUS[:6]:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temporary file left
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "missing.json")


BROKEN_FILES = {
    "garbage bytes": b"\x00\xff\xfe\x89PNG not json at all",
    "empty file": b"",
    "a JSON list": b"[1, 2, 3]",
    "an object of the wrong shape": b'{"version": "1.0", "model": {"type": "Nonsense"}}',
}


@pytest.mark.parametrize("name", [*BROKEN_FILES, "truncated JSON", "a tokenizer without qkv's special ids"])
def test_load_rejects_broken_files_in_one_line(tokenizer, tmp_path, name):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    path = tmp_path / "tokenizer.json"
    if name == "truncated JSON":
        tokenizer.save(path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif name == "a tokenizer without qkv's special ids":
        HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    else:
        path.write_bytes(BROKEN_FILES[name])
    with pytest.raises(ValueError) as info:
        Tokenizer.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not a valid tokenizer file (") and message.endswith(")")
    assert "\n" not in message and len(message) < len(str(path)) + 300


def test_split_digits_and_multi30k_round_trip(multi30k_dir):
    with gzip.open(multi30k_dir / "val.de.gz", "rt", encoding="utf-8") as f:
        german = f.read().splitlines()
    with gzip.open(multi30k_dir / "val.en.gz", "rt", encoding="utf-8") as f:
        english = f.read().splitlines()
    tok = Tokenizer.train(german + english, vocab_size=1000, split_digits=True)
    assert all(tok.decode(tok.encode(line)) == line for line in german + english)
    assert tok.tokens("1998 and 2024")[:4] == ["1", "9", "9", "8"]
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(["x"], vocab_size=100)
