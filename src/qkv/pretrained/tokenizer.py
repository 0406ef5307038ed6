"""The word-piece tokenizer of a BERT checkpoint folder (``tokenizer.json`` or ``vocab.txt``).

Built on the ``tokenizers`` library (the same Rust tokenizer Hugging Face's fast tokenizers use);
padding is done here, to the longest sequence of a batch, with an attention mask.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer as _RustTokenizer
from torch import Tensor

from qkv.data.text import CharTokenizer
from qkv.data.tokenizer import SPECIALS, Tokenizer
from qkv.runtime.fileio import read_json

logger = logging.getLogger(__name__)


def read_backend(path: Path) -> _RustTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library and tried once on a probe text (a
    pair, unknown characters), so a file that loads and then fails at first use, or makes the
    library panic (a Rust panic is a ``BaseException``), is one ``ValueError`` naming it."""
    try:
        backend = _RustTokenizer.from_file(str(path))
        backend.decode(backend.encode("A probe: \u00c4\u00f6 12 \u4e2d \U0001f600", "and a pair").ids)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - a bare Exception for a bad layout; a panic is a BaseException
        raise ValueError(f"{path}: not a valid tokenizer file ({_first_line(err)})") from None
    return backend


def id_span(backend: _RustTokenizer) -> int:
    """The highest id of a ``tokenizers`` tokenizer plus one (added tokens included): the rows an
    embedding needs, which is more than the token count when a file's ids leave gaps."""
    return max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1


@dataclass
class EncodedBatch:
    """Token ids and masks for a batch, right-padded to the longest sequence."""

    input_ids: Tensor  # (b, s) int64
    attention_mask: Tensor  # (b, s) int64, 1 = real token, 0 = padding
    token_type_ids: Tensor  # (b, s) int64 segment ids
    tokens: list[list[str]]  # the real tokens of each sequence (no padding)

    def to(self, device: torch.device | str) -> EncodedBatch:
        """The batch with its tensors on ``device``."""
        return EncodedBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.token_type_ids.to(device), self.tokens
        )


class WordPieceTokenizer:
    """A BERT tokenizer: ``[CLS] text [SEP]`` (``[CLS] a [SEP] b [SEP]`` for pairs), padded batches.

    Args:
        backend: a ``tokenizers.Tokenizer`` whose post-processor adds the special tokens.
        max_length: truncate longer inputs to this many tokens (specials included).
        pad_token: the padding token.
    """

    def __init__(self, backend: _RustTokenizer, *, max_length: int = 512, pad_token: str = "[PAD]") -> None:
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (room for [CLS] and [SEP]), got {max_length}")
        pad_id = backend.token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"tokenizer has no padding token {pad_token!r}")
        self.pad_id: int = pad_id
        self.backend = backend
        self.backend.no_padding()  # we pad to the longest in the batch ourselves
        self.backend.enable_truncation(max_length)
        self.max_length = max_length

    @classmethod
    def from_folder(cls, folder: str | Path, *, max_length: int = 512) -> WordPieceTokenizer:
        """Read ``tokenizer.json``, or else ``vocab.txt`` (+ ``tokenizer_config.json`` for casing)."""
        folder = Path(folder)
        tokenizer_json, vocab_txt = folder / "tokenizer.json", folder / "vocab.txt"
        settings = _read_json(folder / "tokenizer_config.json")
        max_length = min(max_length, int(settings.get("model_max_length", max_length) or max_length))
        if tokenizer_json.is_file():
            backend = read_backend(tokenizer_json)
        elif vocab_txt.is_file():
            from tokenizers.implementations import BertWordPieceTokenizer

            lowercase = bool(settings.get("do_lower_case", True))
            strip_accents = settings.get("strip_accents")
            backend = BertWordPieceTokenizer(
                str(vocab_txt),
                lowercase=lowercase,
                strip_accents=lowercase if strip_accents is None else bool(strip_accents),
                handle_chinese_chars=bool(settings.get("tokenize_chinese_chars", True)),
            )._tokenizer
        else:
            raise FileNotFoundError(f"{folder}: no tokenizer.json or vocab.txt")
        return cls(backend, max_length=max_length)

    @property
    def vocab_size(self) -> int:
        """The ids an embedding must cover: the highest id plus one (what the load checks compare)."""
        return id_span(self.backend)

    def __call__(self, texts: str | list[str], pairs: list[str] | None = None) -> EncodedBatch:
        """Tokenize a text or a batch of texts (optionally text pairs) into padded tensors.

        Args:
            texts: one string or a list of strings.
            pairs: second segments, one per text (token type 1), or None.

        Returns:
            :class:`EncodedBatch` with ``(b, s)`` tensors.
        """
        if isinstance(texts, str):
            texts = [texts]
        if not texts:
            raise ValueError("no texts to tokenize")
        if pairs is not None:
            if len(pairs) != len(texts):
                raise ValueError(f"got {len(texts)} texts but {len(pairs)} pairs")
            encodings = self.backend.encode_batch(list(zip(texts, pairs)))
        else:
            encodings = self.backend.encode_batch(list(texts))
        truncated = sum(1 for e in encodings if e.overflowing)
        if truncated:
            logger.warning("%d of %d inputs were truncated to %d tokens", truncated, len(encodings), self.max_length)
        longest = max(len(e.ids) for e in encodings)
        ids = torch.full((len(encodings), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encodings), longest), dtype=torch.long)
        types = torch.zeros((len(encodings), longest), dtype=torch.long)
        for row, e in enumerate(encodings):
            n = len(e.ids)
            ids[row, :n] = torch.tensor(e.ids, dtype=torch.long)
            mask[row, :n] = 1
            types[row, :n] = torch.tensor(e.type_ids, dtype=torch.long)
        return EncodedBatch(ids, mask, types, [list(e.tokens) for e in encodings])

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Each id's token string (None for an id the vocabulary lacks)."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)


QkvTextTokenizer = CharTokenizer | Tokenizer  # a qkv language model's tokenizer classes


def qkv_text_tokenizer(folder: Path) -> QkvTextTokenizer | None:
    """The tokenizer of a language-model folder ``qkv export --to hf`` wrote, as the run's own
    class, or None for any other folder (a real GPT-2's byte-level BPE).

    qkv writes a character tokenizer as a ``tokenizers`` word-level model over single characters
    (ids in sorted order, no unknown token) and a BPE one with qkv's special tokens at ids 0-3;
    reading them back as :class:`~qkv.data.text.CharTokenizer` / :class:`~qkv.data.tokenizer.Tokenizer`
    encodes and decodes as the run did (an unseen character is refused, special ids are not
    printed)."""
    path = folder / "tokenizer.json"
    data = read_json(path) if path.is_file() else None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        return None
    vocab = model.get("vocab")
    if model.get("type") == "WordLevel" and isinstance(vocab, dict):
        chars = sorted(vocab, key=lambda token: vocab[token])
        single = bool(chars) and all(len(c) == 1 for c in chars) and chars == sorted(chars)
        if single and [vocab[c] for c in chars] == list(range(len(chars))):
            return CharTokenizer(chars)
        return None
    qkv_specials = isinstance(vocab, dict) and all(vocab.get(token) == i for i, token in enumerate(SPECIALS))
    return Tokenizer.load(path) if model.get("type") == "BPE" and qkv_specials else None


def _read_json(path: Path) -> dict:
    """``tokenizer_config.json`` ({} if absent): an object whose settings qkv reads have their types."""
    if not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    length = data.get("model_max_length")
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, (int, float)) or not 2 <= length < float("inf")
    ):  # [CLS] and [SEP] must fit; NaN and infinity refused
        raise ValueError(f"{path}: model_max_length is {length!r}, not a finite number of at least 2")
    for key in ("do_lower_case", "strip_accents", "tokenize_chinese_chars"):
        if data.get(key) is not None and not isinstance(data[key], bool):
            raise ValueError(f"{path}: {key} is {data[key]!r}, not true or false")
    return data


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
