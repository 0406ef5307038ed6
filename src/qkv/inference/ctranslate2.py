"""The CTranslate2 engine: translating with a folder ``qkv export --to ctranslate2`` wrote.

The folder holds CTranslate2's model, the run's ``tokenizer.json`` and :data:`MANIFEST` (special ids,
limits, the run's decoding settings). :class:`Ct2Translator` wraps ``ctranslate2.Translator`` with
qkv's tokenizer and decides what qkv's own decoding decides (sources cut to the positional table,
EOS appended, a sentence stopped after its length + :data:`EXTRA_LEN` tokens, EOS allowed first), so
its float32 translations are qkv's with ``penalty="power"``. Writing such a folder (and converting a
run into a temporary one) is :mod:`qkv.export.ctranslate2`.
"""

from __future__ import annotations

from pathlib import Path

from qkv.data.tokenizer import Tokenizer
from qkv.inference.decode import DecodeConfig
from qkv.inference.policy import check_engine
from qkv.runtime.fileio import read_json

MANIFEST = "qkv_ct2.json"
MANIFEST_FORMAT = 1
EXTRA_LEN = 50  # greedy_decode/beam_search: a sentence stops after source length + 50 tokens
# CTranslate2's compute types (ctranslate2.Translator's compute_type); which a machine supports is
# ctranslate2.get_supported_compute_types("cpu") (an unsupported one is refused by CTranslate2, one line)
COMPUTE_TYPES = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16")

__all__ = ["COMPUTE_TYPES", "EXTRA_LEN", "MANIFEST", "MANIFEST_FORMAT", "Ct2Translator", "ct2_device", "vocabulary"]


def vocabulary(tokenizer: Tokenizer, size: int) -> list[str]:
    """One distinct token string per model id ``0 .. size - 1``: the tokenizer's own strings, then
    placeholders for rows a model's embedding may have beyond the tokenizer (never produced by it).

    Args:
        tokenizer: the run's tokenizer.
        size: the model's vocabulary size.

    Returns:
        The strings, indexed by id.

    Raises:
        ValueError: the tokenizer's strings are not distinct.
    """
    known = min(size, tokenizer.vocab_size)
    tokens = [tokenizer.backend.id_to_token(i) or f"<qkv_unused_{i}>" for i in range(known)]
    tokens += [f"<qkv_unused_{i}>" for i in range(known, size)]
    if len(set(tokens)) != size:
        raise ValueError(f"the tokenizer's token strings are not distinct ({len(set(tokens))} of {size})")
    return tokens


def ct2_device(device_type: str, asked: str | None) -> str:
    """Where CTranslate2 runs, given the device qkv picked (its type) and the one the user asked for.

    Args:
        device_type: ``"cuda"`` or ``"cpu"`` (what :func:`qkv.runtime.device.pick_device` chose).
        asked: the ``--device`` the user gave (None: qkv's default).

    Returns:
        ``"cuda"`` or ``"cpu"``: qkv's default of CUDA falls back to the CPU when CTranslate2 has no CUDA.

    Raises:
        ValueError: CUDA asked for by name and CTranslate2 built without it.
    """
    import ctranslate2

    if device_type != "cuda":
        return "cpu"
    if ctranslate2.get_cuda_device_count() > 0:
        return "cuda"
    if asked:
        raise ValueError(f"--device {asked}: this CTranslate2 was built without CUDA")
    return "cpu"


class Ct2Translator:
    """Translate text with an exported folder: qkv's tokenizer around ``ctranslate2.Translator``
    (a :class:`~qkv.inference.engines.Translator`).

    Args:
        folder: an export of :func:`qkv.export.ctranslate2.export_ctranslate2`.
        device, threads, compute_type: ``ctranslate2.Translator``'s device, intra_threads and compute_type.
    """

    name = "ctranslate2"

    def __init__(self, folder: str | Path, *, device: str = "cpu", threads: int = 1, compute_type: str = "default"):
        import ctranslate2

        folder = Path(folder)
        if not (folder / MANIFEST).is_file():
            raise FileNotFoundError(f"{folder}: {MANIFEST} missing; not a qkv CTranslate2 export")
        self.manifest = read_json(folder / MANIFEST)
        if self.manifest.get("qkv_ct2") != MANIFEST_FORMAT:
            raise ValueError(f"{folder}: {MANIFEST} has format {self.manifest.get('qkv_ct2')!r}, expected 1")
        self.tokenizer = Tokenizer.load(folder / "tokenizer.json")
        self.translator = ctranslate2.Translator(
            str(folder), device=device, intra_threads=threads, compute_type=compute_type
        )
        self.tokens = vocabulary(self.tokenizer, self.manifest["vocab_size"])
        self.ids = {token: i for i, token in enumerate(self.tokens)}

    @property
    def default_decode(self) -> DecodeConfig:
        """The run's own beam size and length penalty (saved in the manifest), in CTranslate2's form."""
        return DecodeConfig.of_run({"decode": self.manifest["decode"]}, penalty="power")

    def to_tokens(self, ids: list[int]) -> list[str]:
        """CTranslate2's token strings for qkv ids."""
        return [self.tokens[i] for i in ids]

    def translate(
        self,
        texts: list[str],
        decode: DecodeConfig | None = None,
        *,
        beam_size: int | None = None,
        alpha: float | None = None,
    ) -> list[str]:
        """Translate ``texts`` as qkv does: sources cut to the positional table, EOS appended, each
        sentence stopped after its length + 50 tokens (capped by the table), EOS allowed at the first
        step (an empty translation is a finished hypothesis, as in qkv's beam search and Hugging Face's:
        CTranslate2 by default forbids it, and then searches on where qkv has its ``beam_size`` finished).

        Args:
            texts: source sentences.
            decode: beam size and length penalty (its penalty form must be ``"power"`` or None: the only
                one CTranslate2 has); ``beam_size`` and ``alpha`` go over it.
            beam_size: 1 = greedy; default: the run's (its recipe's) beam size.
            alpha: CTranslate2's length penalty (log-probability divided by ``length ** alpha``, EOS
                counted: qkv's ``penalty="power"``; qkv's default is GNMT's ``((5 + length) / 6) ** alpha``);
                default: the run's alpha.

        Returns:
            the translations, one per input sentence.
        """
        if decode is not None:
            check_engine(self.name, penalty=decode.penalty)
            beam_size = decode.beam_size if beam_size is None else beam_size
            alpha = decode.alpha if alpha is None else alpha
        limit = self.manifest["max_len"] - 1
        sources = [ids[:limit] + [self.manifest["eos_id"]] for ids in self.tokenizer.encode_batch(texts)]
        outputs = self.translate_ids(sources, beam_size=beam_size, alpha=alpha)
        return [self.tokenizer.decode(ids) for ids in outputs]

    def translate_ids(
        self, sources: list[list[int]], *, beam_size: int | None = None, alpha: float | None = None
    ) -> list[list[int]]:
        """Translate token ids (each source ending with EOS, no padding) to token ids without BOS and
        EOS, as :func:`qkv.decoding.search.greedy_decode` and ``beam_search`` return them; arguments
        as in :meth:`translate`."""
        decode = self.manifest["decode"]
        beam_size = decode["beam_size"] if beam_size is None else beam_size
        alpha = decode["alpha"] if alpha is None else alpha
        limit = self.manifest["max_len"] - 1
        groups: dict[int, list[int]] = {}  # CTranslate2 takes one length limit per call
        for i, ids in enumerate(sources):
            groups.setdefault(min(len(ids) + self.manifest["extra_len"], limit), []).append(i)
        results: list[list[int]] = [[] for _ in sources]
        for max_length, indices in groups.items():
            outputs = self.translator.translate_batch(
                [self.to_tokens(sources[i]) for i in indices],
                beam_size=beam_size,
                length_penalty=alpha if beam_size > 1 else 0.0,
                max_decoding_length=max_length,
                max_input_length=0,  # the sources are already cut to the positional table
                min_decoding_length=0,  # EOS allowed first, as in qkv (CTranslate2's default, 1, forbids it)
            )
            for i, output in zip(indices, outputs, strict=True):
                results[i] = [self.ids[token] for token in output.hypotheses[0]]
        return results

    def close(self) -> None:
        """Free CTranslate2's copy of the model; the translator translates no more after this."""
        self.translator.unload_model()
