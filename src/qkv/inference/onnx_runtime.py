"""The ONNX Runtime engine: greedy translation over an ONNX export (:func:`qkv.export.onnx.export_onnx`).

:class:`OnnxTranslator` runs encoder.onnx once per batch and decoder_step.onnx once per decoded
token, feeding each step's self-attention keys and values back in, and decides every step as
:func:`qkv.decoding.search.greedy_decode` does (same batches, same stopping rule, same length
limit), so its translations are qkv's greedy ones. PyTorch computes nothing here: numpy holds the
tensors between the calls. It is a :class:`~qkv.inference.engines.Translator`; qkv 1.x had it at
``qkv.export.onnx_runtime``, which re-exports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qkv.data.tokenizer import Tokenizer
from qkv.decoding.translate import length_batches
from qkv.inference.decode import DecodeConfig
from qkv.inference.policy import check_engine
from qkv.runtime.fileio import read_json

MANIFEST_FORMAT = 1  # the manifest's "qkv_onnx" value; raise it when the graphs' interface changes

__all__ = ["MANIFEST_FORMAT", "OnnxTranslator", "pad_batch"]


def import_onnxruntime() -> Any:
    """The ``onnxruntime`` module, or an ImportError that says how to install it."""
    try:
        import onnxruntime
    except ImportError:
        raise ImportError(
            "onnxruntime is not installed; install qkv's deploy extra: pip install 'qkv[deploy]'"
        ) from None
    return onnxruntime


def pad_batch(seqs: list[list[int]], pad_id: int) -> np.ndarray:
    """Right-pad token lists into a ``(len(seqs), longest)`` int64 array."""
    out = np.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=np.int64)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = seq
    return out


class OnnxTranslator:
    """Greedy translation with the two graphs of an ONNX export (a :class:`~qkv.inference.engines.Translator`).

    Args:
        folder: what :func:`qkv.export.onnx.export_onnx` wrote.
        threads: onnxruntime's intra-op threads (None: its default, every core).
        providers: onnxruntime execution providers (None: the CPU).
    """

    name = "onnx"

    def __init__(
        self, folder: str | Path, *, threads: int | None = None, providers: Sequence[str] | None = None
    ) -> None:
        ort = import_onnxruntime()
        folder = Path(folder)
        path = folder / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not a qkv ONNX export (manifest.json missing)")
        manifest = read_json(path)
        if not isinstance(manifest, dict) or manifest.get("qkv_onnx") != MANIFEST_FORMAT:
            found = manifest.get("qkv_onnx") if isinstance(manifest, dict) else None
            raise ValueError(f"{path}: ONNX export format {found!r}, this qkv reads {MANIFEST_FORMAT}")
        self.manifest = manifest
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        chosen = list(providers) if providers is not None else ["CPUExecutionProvider"]
        files = manifest["files"]
        self.encoder = ort.InferenceSession(str(folder / files["encoder"]), options, providers=chosen)
        self.decoder = ort.InferenceSession(str(folder / files["decoder_step"]), options, providers=chosen)
        self.tokenizer = Tokenizer.load(folder / files["tokenizer"])
        self.pad_id, self.bos_id, self.eos_id = manifest["pad_id"], manifest["bos_id"], manifest["eos_id"]
        self.max_len, self.extra_len = manifest["max_len"], manifest["extra_len"]

    def encode(self, src: np.ndarray) -> list[np.ndarray]:
        """``src (b, s_src)`` int64 padded ids -> ``[memory (b, s_src, d), cross_key_0, cross_value_0, ...]``."""
        return list(self.encoder.run(self.manifest["encoder"]["outputs"], {"src": src}))

    def step(
        self, token: np.ndarray, src_mask: np.ndarray, self_kv: list[np.ndarray], cross_kv: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One decoder step: ``token (b, 1)``, ``src_mask (b, s_src)`` bool (True = real), the self-attention
        keys/values so far (``(b, h, t, d_h)`` each, layer by layer, key before value) and the encoder's
        cross-attention ones. Returns ``logits (b, V)`` and the self-attention keys/values with this step's."""
        names = self.manifest["decoder_step"]
        feeds = dict(zip(names["inputs"], [token, src_mask, *self_kv, *cross_kv]))
        logits, *new_self = self.decoder.run(names["outputs"], feeds)
        return logits, new_self

    def greedy(self, src: np.ndarray) -> list[list[int]]:
        """Greedy decoding of a padded batch ``src (b, s_src)`` as :func:`qkv.decoding.search.greedy_decode`:
        one list of ids per sentence, without BOS and EOS."""
        b = src.shape[0]
        cross_kv = self.encode(src)[1:]
        src_mask = src != self.pad_id
        max_len = np.minimum(src_mask.sum(axis=1) + self.extra_len, self.max_len - 1)  # (b,)
        heads, head_dim = self.manifest["num_heads"], self.manifest["head_dim"]
        self_kv = [np.zeros((b, heads, 0, head_dim), dtype=np.float32) for _ in cross_kv]
        tokens = np.full((b, 1), self.bos_id, dtype=np.int64)  # (b, t)
        finished = np.zeros(b, dtype=bool)
        lengths = max_len.copy()
        for step in range(int(max_len.max())):
            logits, self_kv = self.step(tokens[:, -1:], src_mask, self_kv, cross_kv)
            next_token = np.where(finished, self.pad_id, logits.argmax(axis=-1))  # (b,)
            just_ended = ~finished & (next_token == self.eos_id)
            lengths = np.where(just_ended, step, lengths)
            finished |= just_ended | (step + 1 >= max_len)
            tokens = np.concatenate([tokens, next_token[:, None].astype(np.int64)], axis=1)
            if finished.all():
                break
        return [tokens[i, 1 : 1 + int(lengths[i])].tolist() for i in range(b)]

    def translate(
        self, texts: list[str], decode: DecodeConfig | None = None, *, max_tokens: int | None = None
    ) -> list[str]:
        """Translate ``texts`` greedily, in the batches :func:`qkv.decoding.translate.translate_texts` makes
        (``max_tokens`` source tokens each, sorted by length); output in input order.

        Args:
            texts: source sentences.
            decode: its ``max_batch_tokens``; its beam size must be 1 (the graphs decode greedily).
            max_tokens: source tokens per batch (over ``decode``'s; default 4000).

        Returns:
            the translations, one per input sentence.
        """
        if decode is not None:
            check_engine(self.name, beam_size=decode.beam_size, penalty=decode.penalty)
            max_tokens = decode.max_batch_tokens if max_tokens is None else max_tokens
        max_tokens = 4000 if max_tokens is None else max_tokens
        limit = self.max_len - 1  # source tokens that fit the positional table with EOS, as qkv cuts them
        ids = [s[:limit] + [self.eos_id] for s in self.tokenizer.encode_batch(texts)]
        results = [""] * len(ids)
        for batch in length_batches(ids, max(1, max_tokens)):
            out = self.greedy(pad_batch([ids[i] for i in batch], self.pad_id))
            for i, tokens in zip(batch, out):
                results[i] = self.tokenizer.decode(tokens)
        return results

    def close(self) -> None:
        """Drop the two onnxruntime sessions; the translator translates no more after this."""
        del self.encoder, self.decoder
