"""What the GPU benchmark (:mod:`qkv.bench.gpu`) trains: its model sizes, its batches and its
contenders, each a training step of qkv's own :class:`~qkv.training.Trainer`.

* Sections: ``paper-base`` and ``paper-big`` (the recipes' sizes: Table 3 of the paper, one BPE
  vocabulary of 37,000 tokens, ~25,000 target tokens a step) and ``lm`` (GPT-2 small: 12 layers,
  768 wide, context 1024, ~25,000 tokens a step); ``--sizes tiny`` shrinks all three for the CPU.
* Batches: generated WMT-like pairs (lognormal lengths around 24 tokens with a long tail, the target
  about as long as the source, Zipf-distributed ids), length-sorted and cut at the step's target
  tokens as token-count batching does, or the training pairs of a ``qkv prepare`` folder.
* Contenders: ``qkv`` (eager), ``qkv+compile`` (``torch.compile`` of the loss call, as ``qkv train
  --compile``) and the Hugging Face model of the same size: ``MarianMTModel`` for translation,
  ``GPT2LMHeadModel`` for the language model, both with SDPA attention. Every contender takes the
  same batches in the same order, under bf16 autocast on CUDA (float32 on the CPU), with the same
  label-smoothed loss summed over target tokens, Adam and the paper's schedule.

Shape legend: ``b`` sentences or windows, ``s`` padded length, ``V`` vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.bench.competitors import build_marian
from qkv.data.batching import Batch, make_batch
from qkv.models.causal_lm import IGNORE, CausalLM, CausalLMConfig
from qkv.models.flops import causal_lm_train_flops, transformer_train_flops
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.nn.loss import label_smoothed_cross_entropy
from qkv.runs.language_model import LANGUAGE_MODEL
from qkv.runs.recipes import load_recipe
from qkv.runs.translation_kind import TRANSLATION
from qkv.training import TrainConfig, Trainer
from qkv.training.language_model_task import LanguageModelTask, WindowBatch, language_model_loss
from qkv.training.objectives import Objective, cross_entropy_smoothing
from qkv.training.tasks import TranslationTask, translation_loss

PAD, BOS, EOS = 0, 1, 2  # the generated data's ids (qkv's tokenizer: 0-3 are pad, BOS, EOS, UNK)
SECTIONS = ("paper-base", "paper-big", "lm")
SIZES = ("paper", "tiny")
HF_NAMES = {TRANSLATION.name: "marian", LANGUAGE_MODEL.name: "gpt2"}  # a section's task -> its HF contender
POOL = 16  # generated pairs: this many times those the batches need


@dataclass(frozen=True)
class Section:
    """One size measured: its model config, its task and the tokens a training step takes."""

    name: str
    task: str  # the run kind's name (qkv.runs.kinds): TRANSLATION.name or LANGUAGE_MODEL.name
    config: TransformerConfig | CausalLMConfig
    tokens_per_step: int
    label_smoothing: float

    @property
    def contenders(self) -> tuple[str, str, str]:
        """The names timed in this section: qkv, qkv compiled, and the Hugging Face model."""
        return ("qkv", "qkv+compile", HF_NAMES[self.task])


def sections(sizes: str, *, vocab_size: int | None = None, pad_id: int = PAD) -> dict[str, Section]:
    """The three sections at ``sizes`` (``paper`` or ``tiny``); ``vocab_size``/``pad_id``: a
    prepared folder's tokenizer's, for the translation models."""
    if sizes not in SIZES:
        raise ValueError(f"unknown --sizes {sizes!r}; choose from {', '.join(SIZES)}")
    if sizes == "tiny":
        vocab = vocab_size or 256

        def tiny(d_model: int, heads: int, layers: int, dropout: float) -> TransformerConfig:
            return TransformerConfig(
                src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, num_heads=heads,
                num_encoder_layers=layers, num_decoder_layers=layers, d_ff=2 * d_model, dropout=dropout,
                max_len=64, share_embeddings=True, tie_output=True, pad_id=pad_id,
            )  # fmt: skip

        base, big = tiny(32, 2, 1, 0.1), tiny(64, 4, 2, 0.3)
        lm = CausalLMConfig(vocab_size=256, d_model=32, num_heads=2, num_layers=2, d_ff=128, context=32)
        tokens = 256
    else:
        base, big = (_recipe_config(name, vocab_size, pad_id) for name in ("paper-base", "paper-big"))
        lm = CausalLMConfig()  # GPT-2 small
        tokens = 25_000
    return {
        "paper-base": Section("paper-base", TRANSLATION.name, base, tokens, 0.1),
        "paper-big": Section("paper-big", TRANSLATION.name, big, tokens, 0.1),
        "lm": Section("lm", LANGUAGE_MODEL.name, lm, tokens, 0.0),
    }


def _recipe_config(name: str, vocab_size: int | None, pad_id: int) -> TransformerConfig:
    recipe = load_recipe(name)
    vocab = vocab_size or recipe.vocab_size
    return TransformerConfig(**{**recipe.model, "src_vocab_size": vocab, "tgt_vocab_size": vocab, "pad_id": pad_id})


# ----------------------------------------------------------------------------- batches
def zipf_ids(rng: np.random.Generator, count: int, vocab_size: int) -> np.ndarray:
    """``count`` ids in ``[4, vocab_size)``, rank ``r`` drawn with weight ``1 / (r + 2.7)``."""
    weights = 1.0 / (np.arange(vocab_size - 4) + 1 + 2.7)
    cdf = np.cumsum(weights) / weights.sum()
    return 4 + np.minimum(np.searchsorted(cdf, rng.random(count)), vocab_size - 5)


def wmt_like_lengths(rng: np.random.Generator, count: int, longest: int) -> tuple[np.ndarray, np.ndarray]:
    """Source and target token counts (without BOS/EOS) of ``count`` WMT-like pairs: lognormal,
    median 24 tokens, a long tail cut at ``longest``; the target the source's times ~1.05."""
    src = np.exp(rng.normal(np.log(24.0), 0.55, count))
    tgt = src * np.exp(rng.normal(np.log(1.05), 0.15, count))
    return (np.clip(np.rint(x), 1, longest).astype(np.int64) for x in (src, tgt))  # type: ignore[return-value]


def cut_by_target_tokens(src_lens: np.ndarray, tgt_lens: np.ndarray, tokens_per_step: int) -> list[np.ndarray]:
    """Pairs sorted by length and cut into consecutive batches of about ``tokens_per_step`` target
    tokens (EOS counted), as token-count batching groups similar lengths; the last, partial batch
    is dropped. Returns each batch's pair indices."""
    order = np.argsort(np.maximum(src_lens, tgt_lens), kind="stable")
    totals = np.cumsum(tgt_lens[order] + 1)
    ends = np.searchsorted(totals, np.arange(tokens_per_step, totals[-1] + 1, tokens_per_step))
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [order[a : b + 1] for a, b in zip(starts, ends) if b >= a]


def _framed(ids: np.ndarray, lengths: np.ndarray, *, before: int | None, after: int | None) -> Tensor:
    """``(b, s)`` rows of ``lengths`` ids from the flat ``ids``, with BOS before / EOS after, padded."""
    extra = (before is not None) + (after is not None)
    out = np.full((len(lengths), int(lengths.max()) + extra), PAD, dtype=np.int64)
    shift = 1 if before is not None else 0
    mask = np.arange(out.shape[1] - extra)[None, :] < lengths[:, None]
    out[:, shift:][:, : mask.shape[1]][mask] = ids
    if before is not None:
        out[:, 0] = before
    if after is not None:
        out[np.arange(len(lengths)), lengths + shift] = after
    return torch.from_numpy(out)


def generated_batches(section: Section, count: int, seed: int = 0) -> list[Batch]:
    """``count`` batches of generated WMT-like pairs of ~``section.tokens_per_step`` target tokens
    each, their lengths spread over the distribution's, in a shuffled order."""
    config = section.config
    assert isinstance(config, TransformerConfig)
    rng = np.random.default_rng(seed)
    mean_target = 1.05 * 24.0 * np.exp(0.55**2 / 2) + 1
    # a pool POOL times larger than needed, cut into batches of narrow length ranges (little padding,
    # as in a corpus of millions of pairs), of which ``count`` evenly spread over the lengths are kept
    pairs = int(POOL * count * section.tokens_per_step / mean_target) + 64
    src_lens, tgt_lens = wmt_like_lengths(rng, pairs, config.max_len - 2)
    groups = cut_by_target_tokens(src_lens, tgt_lens, section.tokens_per_step)
    chosen = [groups[i] for i in np.linspace(0, len(groups) - 1, min(count, len(groups))).astype(int)]
    batches = []
    for index in chosen:
        s, t = src_lens[index], tgt_lens[index]
        src_ids, tgt_ids = (
            zipf_ids(rng, int(s.sum()), config.src_vocab_size),
            zipf_ids(rng, int(t.sum()), config.tgt_vocab_size),
        )
        tgt_out = _framed(tgt_ids, t, before=None, after=EOS)
        batches.append(
            Batch(
                _framed(src_ids, s, before=None, after=EOS),
                _framed(tgt_ids, t, before=BOS, after=None),
                tgt_out,
                int((tgt_out != PAD).sum()),
            )  # fmt: skip
        )
    return [batches[i] for i in rng.permutation(len(batches))]


def prepared_batches(folder: str | Path, section: Section, count: int, seed: int = 0) -> list[Batch]:
    """``count`` batches of ~``section.tokens_per_step`` target tokens from the training pairs of a
    ``qkv prepare`` folder (pairs drawn at random, then length-sorted and cut)."""
    from qkv.data.prepared import PreparedCorpus

    corpus = PreparedCorpus(folder)
    tokenizer = corpus.tokenizer()
    split = corpus.split("train")
    lengths = split.lengths()  # (pairs, 2): source, target
    rng = np.random.default_rng(seed)
    max_len = section.config.max_len if isinstance(section.config, TransformerConfig) else section.config.context
    usable = np.flatnonzero(lengths.max(axis=1) <= max_len - 2)  # what training keeps (BOS/EOS framed)
    if not len(usable):
        raise ValueError(f"{folder}: no training pair fits the model's {max_len} positions")
    wanted = int(count * section.tokens_per_step / (lengths[usable, 1].mean() + 1) * 1.1) + 64
    picked = rng.choice(usable, size=min(wanted, len(usable)), replace=False)
    groups = cut_by_target_tokens(lengths[picked, 0], lengths[picked, 1], section.tokens_per_step)
    if not groups:
        raise ValueError(f"{folder}: too few training pairs for one batch of {section.tokens_per_step} target tokens")
    batches = []
    for group in groups[:count]:
        src, tgt = split.read(picked[group].tolist())
        batches.append(make_batch(src, tgt, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id))
    return [batches[i] for i in rng.permutation(len(batches))]


def lm_batches(section: Section, count: int, seed: int = 0) -> list[WindowBatch]:
    """``count`` batches of ``tokens_per_step // context`` windows of Zipf-distributed ids."""
    config = section.config
    assert isinstance(config, CausalLMConfig)
    rng = np.random.default_rng(seed)
    rows = max(1, section.tokens_per_step // config.context)
    batches = []
    for _ in range(count):
        stream = torch.from_numpy(zipf_ids(rng, rows * (config.context + 1), config.vocab_size)).view(rows, -1)
        batches.append(WindowBatch(stream[:, :-1].contiguous(), stream[:, 1:].contiguous(), rows * config.context))
    return batches


def batch_lengths(batch: Batch | WindowBatch, pad_id: int) -> tuple[list[int], list[int]]:
    """Real (unpadded) token counts per row: source and target-input for a translation batch, the
    window's for a language-model batch (twice)."""
    if isinstance(batch, WindowBatch):
        rows = [batch.ids.size(1)] * batch.ids.size(0)
        return rows, rows
    return (batch.src != pad_id).sum(1).tolist(), (batch.tgt_in != pad_id).sum(1).tolist()


def batch_flops(section: Section, batch: Batch | WindowBatch) -> int:
    """Model FLOPs of one training step on ``batch`` (:mod:`qkv.models.flops`: real tokens, no
    padding); the same count for qkv's model and the Hugging Face one of the same size."""
    config = section.config
    if isinstance(config, TransformerConfig):
        src, tgt = batch_lengths(batch, config.pad_id)
        return transformer_train_flops(config, src, tgt)
    return causal_lm_train_flops(config, batch_lengths(batch, PAD)[0])


# ----------------------------------------------------------------------------- contenders
def gpt2_same_size(config: CausalLMConfig) -> nn.Module:
    """A randomly initialised ``transformers.GPT2LMHeadModel`` with ``config``'s sizes and SDPA
    attention (pre-LN, learned positions, GELU's tanh form, tied output: qkv's GPT-2 layout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if not (config.norm_first and config.positional == "learned" and config.activation == "gelu_tanh"):
        raise ValueError("the GPT-2 comparison needs qkv's GPT-2 layout: pre-LN, learned positions, gelu_tanh")
    hf_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.context,
        n_embd=config.d_model,
        n_layer=config.num_layers,
        n_head=config.num_heads,
        n_inner=config.d_ff,
        activation_function="gelu_new",  # the tanh approximation
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layer_norm_eps,
        tie_word_embeddings=config.tie_output,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf_config._attn_implementation = "sdpa"  # PyTorch's fused attention, as qkv's
    return GPT2LMHeadModel(hf_config)


def _logits_loss(
    model: nn.Module, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, *, objective: Objective | None = None, pad_id: int
) -> Tensor:
    """MarianMT's summed label-smoothed loss (``objective``'s smoothing), from its logits ``(b, s, V)``."""
    return label_smoothed_cross_entropy(model(src, tgt_in), tgt_out, cross_entropy_smoothing(objective), pad_id)


def _gpt2_loss(model: nn.Module, ids: Tensor, targets: Tensor, *, objective: Objective | None = None) -> Tensor:
    """GPT-2's summed next-token loss from its logits (``ids``, ``targets`` already shifted), with
    ``objective``'s smoothing."""
    logits = model(input_ids=ids, use_cache=False).logits  # (b, s, V)
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum",
        label_smoothing=cross_entropy_smoothing(objective),
    )  # fmt: skip


class _Task:
    """What :meth:`Trainer.step` needs of a task: the loss call (``loss_fn``) and how a batch is fed to it."""

    def __init__(self, loss_fn: Any, loss: Any) -> None:
        self.loss_fn = loss_fn
        self.loss = loss


def build_model(section: Section, family: str) -> nn.Module:
    """``qkv``'s model of the section, or the Hugging Face one of the same size (``marian``/``gpt2``)."""
    config = section.config
    if isinstance(config, TransformerConfig):
        return Transformer(config) if family == "qkv" else build_marian(config, bos_id=BOS, eos_id=EOS)
    return CausalLM(config) if family == "qkv" else gpt2_same_size(config)


def build_trainer(section: Section, family: str, model: nn.Module, *, bf16: bool, compile_model: bool) -> Trainer:
    """qkv's trainer for ``model`` (on its device): the paper's Adam (0.9, 0.98, 1e-9) and
    schedule, no clipping (the recipes'), bf16 autocast when ``bf16``, ``torch.compile`` of the loss
    call when ``compile_model``."""
    config = section.config
    if isinstance(config, TransformerConfig):
        loss_fn = translation_loss if family == "qkv" else functools.partial(_logits_loss, pad_id=config.pad_id)
        task = _Task(loss_fn, TranslationTask.loss)
    else:
        task = _Task(language_model_loss if family == "qkv" else _gpt2_loss, LanguageModelTask.loss)
    train = TrainConfig(
        bf16=bf16,
        compile=compile_model,
        label_smoothing=section.label_smoothing,
        clip_norm=0.0,
        adam_betas=(0.9, 0.98),
        adam_eps=1e-9,
        warmup_steps=4000,
        progress=False,
    )
    step_only: Any = task  # what Trainer.step uses of a Task, no more
    return Trainer(model, step_only, train, d_model=config.d_model)


def state_bytes(trainer: Trainer) -> int:
    """Bytes the contender keeps between steps: its parameters and the optimizer's state."""
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in trainer.model.parameters()}.values())
    for state in trainer.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, Tensor))
    return total
