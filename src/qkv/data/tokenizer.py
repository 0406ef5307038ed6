"""A joint source/target subword tokenizer: byte-level BPE from the ``tokenizers`` library.

Byte-level BPE covers every UTF-8 string with its 256 byte symbols, so nothing is ever unknown and
``decode(encode(x)) == x`` exactly. Special ids are fixed: ``<pad>`` 0 (the model's ``pad_id``),
``<s>`` 1 (BOS), ``</s>`` 2 (EOS), ``<unk>`` 3.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from qkv.runtime.fileio import atomic_path
from qkv.runtime.limits import MAX_VOCAB_SIZE

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
MIN_VOCAB_SIZE = 256 + len(SPECIALS)  # every byte and the specials


def check_vocab_size(vocab_size: object) -> None:
    """A BPE vocabulary size in ``[MIN_VOCAB_SIZE, MAX_VOCAB_SIZE]`` (``ValueError`` naming it).

    Args:
        vocab_size: the size asked for.
    """
    if (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, int)
        or not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE
    ):
        raise ValueError(
            f"vocab_size (--vocab-size) must be an integer from {MIN_VOCAB_SIZE} (256 bytes + 4 specials) "
            f"to {MAX_VOCAB_SIZE:,}, got {vocab_size!r}"
        )


class Tokenizer:
    """Byte-level BPE with a joint vocabulary. Build with :meth:`train` or :meth:`load`."""

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, backend: _HFTokenizer) -> None:
        for i, token in enumerate(SPECIALS):
            if backend.token_to_id(token) != i:
                raise ValueError(f"tokenizer must map {token!r} to id {i}, got {backend.token_to_id(token)}")
        ids = backend.get_vocab(with_added_tokens=True).values()
        size = backend.get_vocab_size(with_added_tokens=True)
        if len(set(ids)) != size or min(ids, default=0) < 0 or max(ids, default=-1) != size - 1:
            raise ValueError(
                f"its ids must be 0..{size - 1} (one per token), got ids up to {max(ids, default=-1)}: "
                "a model's embedding is sized by the token count"
            )
        # a text that spells a special token ("<s>", "</s>", ...) is text: its bytes, not the special id
        # (else the literal string vanished on a round trip and an "</s>" in a sentence ended it)
        backend.encode_special_tokens = True
        self.backend = backend

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2, *, split_digits: bool = False
    ) -> Tokenizer:
        """Learn BPE merges on ``texts`` (pass source and target sentences together for a joint vocabulary).

        Args:
            texts: training sentences.
            vocab_size: final vocabulary size including the 256 byte symbols and 4 specials
                (at least 260).
            min_frequency: a pair must occur this often to be merged.
            split_digits: keep every digit a token of its own (numbers are then copied digit by
                digit; the date task uses it).
        """
        check_vocab_size(vocab_size)  # the tokenizers library aborts the process on one it cannot allocate
        backend = _HFTokenizer(models.BPE(unk_token=UNK))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if split_digits:
            digits = pre_tokenizers.Digits(individual_digits=True)
            backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a ``tokenizer.json`` written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not a tokenizer qkv can use (not UTF-8 JSON, cut short, not a
                ``tokenizers`` tokenizer, or without qkv's special ids), as one line naming the file.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer file not found")

        def invalid(reason: object) -> ValueError:
            lines = str(reason).strip().splitlines() or ["empty error"]
            return ValueError(f"{path}: not a valid tokenizer file ({lines[0][:200]})")

        try:
            text = path.read_bytes().decode("utf-8")
            json.loads(text)  # Python's message for a garbage or cut-short file names line and column
        except UnicodeDecodeError:
            raise invalid("not UTF-8 text") from None
        except json.JSONDecodeError as err:
            raise invalid(f"not JSON: {err}") from None
        try:
            backend = _HFTokenizer.from_str(text)
            tokenizer = cls(backend)
            tokenizer.decode(tokenizer.encode("a probe: ÄÖ 12 <s>"))  # some layouts load, then fail at first use
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - a bare Exception for a bad layout; a Rust panic is a BaseException
            raise invalid(err) from None
        return tokenizer

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` atomically (see :mod:`qkv.runtime.fileio`)."""
        with atomic_path(path) as tmp:
            self.backend.save(str(tmp))

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials and byte symbols included."""
        return self.backend.get_vocab_size()

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by BOS/EOS."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_batch(self, texts: list[str], *, add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """:meth:`encode` for many texts at once (the backend runs them in parallel)."""
        encoded = self.backend.encode_batch(texts, add_special_tokens=False)
        head, tail = ([self.bos_id] if add_bos else []), ([self.eos_id] if add_eos else [])
        return [head + e.ids + tail for e in encoded]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are dropped and decoding stops at the first EOS."""
        kept = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                kept.append(i)
        return self.backend.decode(kept, skip_special_tokens=True)

    def tokens(self, text: str) -> list[str]:
        """Readable token strings of ``text`` (byte symbols shown as text where possible)."""
        return [self.backend.decode([i]) for i in self.encode(text)]
