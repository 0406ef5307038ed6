"""Views of a decoder-only language model (:class:`qkv.CausalLM`): its causal self-attention.

:class:`CausalLMExplorer` reads a text with the model's own tokenizer (a qkv language-model run's
character or byte-level BPE tokenizer, or a GPT-2 folder's), runs the model once with
``need_weights=True`` and returns one "causal self-attention" view with every layer and head:
each token attends to itself and the tokens before it, so every head is lower-triangular.

Token labels are made readable: a space shows as ``␣`` (in byte-level BPE the ``Ġ`` that starts
a word), a newline as ``⏎``, a tab as ``⇥``, other control characters as escapes, and the bytes
of a character split across tokens as ``\\xNN``.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from qkv.inference.kinds import CAUSAL_LM
from qkv.runtime.device import model_device
from qkv.viz.analysis import view_fields
from qkv.viz.attribution import causal_lm_fields
from qkv.viz.export import AttentionView, check_text, make_example
from qkv.viz.saliency import next_token_saliency, saliency_field

if TYPE_CHECKING:
    from qkv.models.causal_lm import CausalLM, CausalLMOutput

logger = logging.getLogger(__name__)

VIEW_NAME = "causal self-attention"


class TextTokenizer(Protocol):
    """What a language-model view needs of a tokenizer (qkv's character and BPE tokenizers, GPT-2's)."""

    @property
    def vocab_size(self) -> int:
        """The number of ids."""

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``."""


VISIBLE = {" ": "\u2423", "\n": "\u23ce", "\t": "\u21e5", "\r": "\u240d"}  # ␣ ⏎ ⇥ ␍


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet, inverted: the printable character each byte is written as -> the
    byte. Bytes that are printable Latin-1 stand for themselves; the others (control characters,
    space, soft hyphen...) are written as the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(0x100 + shifted)] = byte
            shifted += 1
    return table


BYTE_ALPHABET = _byte_alphabet()


def visible(text: str) -> str:
    """``text`` with whitespace and control characters made visible (``' '`` -> ``'␣'``, ``'\\n'``
    -> ``'⏎'``, ``'\\t'`` -> ``'⇥'``, other control characters as ``\\xNN``/``\\uNNNN``)."""
    out = []
    for c in text:
        if c in VISIBLE:
            out.append(VISIBLE[c])
        elif unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out) or "\u2205"  # ∅ for a token that decodes to nothing


def byte_level_text(raw: str) -> str | None:
    """The text a byte-level BPE token stands for (``"Ġflies"`` -> ``" flies"``; bytes that are not
    whole UTF-8 as ``\\xNN``), or None when ``raw`` has characters outside the byte alphabet."""
    if not all(c in BYTE_ALPHABET for c in raw):
        return None
    return bytes(BYTE_ALPHABET[c] for c in raw).decode("utf-8", errors="backslashreplace")


def lm_token_labels(tokenizer: TextTokenizer, ids: Iterable[int]) -> list[str]:
    """One readable label per token id of a language-model tokenizer (see :func:`visible`).

    A character tokenizer (``chars``) gives its characters; a byte-level BPE tokenizer (one with a
    ``tokenizers`` ``backend``, e.g. qkv's BPE or GPT-2's) gives each token's own bytes as text, a
    byte sequence that is not whole UTF-8 as ``\\xNN`` escapes; anything else ``decode([id])``.
    """
    chars = getattr(tokenizer, "chars", None)
    backend = getattr(tokenizer, "backend", None)
    labels = []
    for i in ids:
        i = int(i)
        if chars is not None:
            text = chars[i]
        elif backend is not None:
            raw = backend.id_to_token(i)
            text = byte_level_text(raw) if raw is not None else None
            if text is None:  # an added token written with characters outside the byte alphabet
                text = raw if raw is not None else tokenizer.decode([i])
        else:
            text = tokenizer.decode([i])
        labels.append(visible(text))
    return labels


class CausalLMExplorer:
    """Views of a :class:`qkv.CausalLM`'s causal self-attention.

    Args:
        model: the language model.
        tokenizer: its tokenizer: ``encode(text)`` (raising ``ValueError`` for text it cannot
            encode), ``decode(ids)``; :class:`qkv.data.text.CharTokenizer`, qkv's BPE
            :class:`qkv.data.tokenizer.Tokenizer` or :class:`qkv.pretrained.gpt2.GPT2Tokenizer`.
        name: the model's name shown in the explorer.
        sample_text: a text the tokenizer can encode, for when the default sentence cannot be
            (``qkv serve`` draws it when the page opens); e.g. the start of the run's own text.
    """

    kind: ClassVar[str] = CAUSAL_LM.serve_kind

    def __init__(self, *, model: CausalLM, tokenizer: TextTokenizer, name: str, sample_text: str | None = None) -> None:
        for attr in ("encode", "decode"):
            if not hasattr(tokenizer, attr):
                raise ValueError(f"the tokenizer has no {attr!r}; a language-model view needs encode/decode")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.lens = True  # the logit lens and attribution views (qkv attend --no-lens: False)
        self.name = name
        self.sample_text = sample_text

    @property
    def context(self) -> int:
        """The longest context the model reads, in tokens."""
        return self.model.config.context

    def encodes(self, text: str) -> bool:
        """Whether ``text`` is non-empty and every character of it is in the tokenizer's vocabulary."""
        try:
            return bool(text.strip()) and bool(self.tokenizer.encode(text))
        except ValueError:
            return False

    def _ids(self, text: str) -> tuple[list[int], str]:
        """The text's ids, cropped from the left to the context, and a note saying so (or "")."""
        check_text(text)
        try:
            ids = list(self.tokenizer.encode(text))
        except ValueError as err:
            raise ValueError(f"cannot encode the text: {str(err).splitlines()[0]}") from None
        if not ids:
            raise ValueError("the text has no tokens")
        note = ""
        if len(ids) > self.context:
            note = f"; showing its last {self.context} of {len(ids)} tokens (the model's context)"
            logger.info(
                "%s: the text has %d tokens; showing the last %d (the model's context)",
                self.name,
                len(ids),
                self.context,
            )
            ids = ids[-self.context :]
        return ids, note

    @torch.no_grad()
    def _run(self, ids: list[int]) -> tuple[torch.Tensor, CausalLMOutput, AttentionView]:
        x = torch.tensor([ids], dtype=torch.long, device=model_device(self.model))  # (1, s)
        out: CausalLMOutput = self.model(x, need_weights=True)
        assert out.attentions is not None  # need_weights
        tokens = lm_token_labels(self.tokenizer, ids)
        view = AttentionView(VIEW_NAME, tokens, tokens, list(out.attentions))  # per layer (1, h, s, s)
        return x, out, view

    def views(self, text: str) -> list[AttentionView]:
        """The attention views of ``text`` (one: the causal self-attention), without the analysis."""
        return [self._run(self._ids(text)[0])[2]]

    def example(self, text: str) -> dict[str, Any]:
        """Encode ``text``, keep its last ``context`` tokens, run the model once with
        ``need_weights=True`` and return an explorer example (see :mod:`qkv.viz.export`): one
        view with every layer and head and its head statistics, labels and rollout
        (:mod:`qkv.viz.analysis`), the most likely next token as its output, and the saliency of
        that token's log-probability over the text's tokens (:mod:`qkv.viz.saliency`).

        Raises:
            ValueError: the text is empty, or has characters the vocabulary lacks (one line).
        """
        ids, note = self._ids(text)
        x, out, view = self._run(ids)
        assert out.logits is not None  # the model projects to the vocabulary unless asked not to
        probs = torch.softmax(out.logits[0, -1].float(), dim=-1)  # (V,)
        best = int(probs.argmax())
        label = lm_token_labels(self.tokenizer, [best])[0] if best < _vocab_size(self.tokenizer) else f"#{best}"
        output = f"most likely next token: {label} (p = {float(probs[best]):.3f}){note}"
        example = make_example(text, [view], model=self.name, output=output)
        example["views"][0].update(view_fields(view))
        scores = next_token_saliency(self.model, x, best).cpu()  # (s,)
        example["saliency"] = saliency_field(
            about="log-probability of the most likely next token",
            inputs=view.keys,
            outputs=[label],
            scores=scores[None],
            attention=view.attentions[-1].mean(0)[-1:],  # the last row predicts it
        )
        if self.lens:  # the logit lens and the attribution of a continuation: a few more passes
            example.update(causal_lm_fields(self.model, x, self._labels))
        return example

    def _labels(self, ids: Iterable[int]) -> list[str]:
        """Readable labels of token ids; an id past the tokenizer's vocabulary (a padded output) as ``#id``."""
        known = _vocab_size(self.tokenizer)
        return [lm_token_labels(self.tokenizer, [i])[0] if not known or i < known else f"#{i}" for i in ids]


def _vocab_size(tokenizer: object) -> int:
    return int(getattr(tokenizer, "vocab_size", 0) or 0)


def run_sample_text(run_dir: str | Path, tokenizer: TextTokenizer, *, max_chars: int = 60) -> str | None:
    """The first line of a language-model run's own text (its validation split, else its training
    split), up to ``max_chars`` characters; None when neither can be read."""
    from qkv.data.text import read_tokens

    for name in ("val.bin", "train.bin"):
        try:
            ids = read_tokens(Path(run_dir) / name, tokenizer.vocab_size)[: 4 * max_chars]
            text = tokenizer.decode([int(i) for i in ids])
        except (OSError, ValueError, IndexError):
            continue
        for line in text.splitlines():
            line = line.strip()[:max_chars].strip()
            if line:
                return line
    return None
