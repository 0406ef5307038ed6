"""The run's tokenizer as a Hugging Face tokenizer folder that ``AutoTokenizer.from_pretrained`` loads.

A translation run's byte-level BPE is copied as it is, with a post-processor that appends ``</s>``
(qkv frames every source sentence ``ids + [EOS]``, as Marian's tokenizers do), its special tokens
named, and ``split_special_tokens`` set: qkv reads a text that spells ``<s>`` as text, never as the
special id. A language model's character tokenizer becomes a word-level ``tokenizers`` model over
single characters (one token per character, joined without spaces when decoding).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from qkv.data.text import CharTokenizer
from qkv.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizer


def save_bpe_tokenizer(tokenizer: Tokenizer, folder: Path, *, max_len: int, append_eos: bool) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for qkv's byte-level BPE into ``folder``.

    Args:
        tokenizer: the run's tokenizer.
        folder: where the files go (it exists).
        max_len: the longest sequence the model takes (``model_max_length``).
        append_eos: add ``</s>`` after every encoded text (a translation model's source framing).
    """
    from transformers import PreTrainedTokenizerFast

    backend = RustTokenizer.from_str(tokenizer.backend.to_str())
    if append_eos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS}", pair=f"$A $B {EOS}", special_tokens=[(EOS, tokenizer.eos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        split_special_tokens=True,  # "<s>" typed in a text is text, as in qkv
        clean_up_tokenization_spaces=False,  # decode exactly, as qkv does
        model_max_length=max_len,
    )
    fast.save_pretrained(str(folder))


def save_char_tokenizer(tokenizer: CharTokenizer, folder: Path, *, max_len: int) -> None:
    """Write a character tokenizer as ``tokenizer.json`` (word level, one token per character) and
    ``tokenizer_config.json`` into ``folder``. It has no special tokens, as qkv's has none."""
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(tokenizer.chars)}
    # WordLevel wants an unknown token's name; none is in the vocabulary, so an unseen character
    # fails to encode, as in qkv, instead of becoming some id
    backend = RustTokenizer(models.WordLevel(vocab, unk_token="\x00<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, model_max_length=max_len
    )
    fast.save_pretrained(str(folder))
