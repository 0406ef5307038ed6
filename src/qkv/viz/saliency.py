"""What an output depended on: gradient x input saliency of the input tokens.

For an output ``y`` (a scalar) and the input tokens' embeddings ``e_j`` (the token embedding
table's rows, before positions are added or any scaling), token ``j``'s score is
``sum_d e_jd * dy/de_jd``: the first-order change of ``y`` when that token's embedding is scaled
from 0 to itself (Shrikumar et al. 2016; Ecco's "gradient x input"). It is signed: positive
raises the output, negative lowers it. Attention weights are a different thing (how a layer mixes
positions, not what changes the output), which is why the explorer shows both.

* :func:`translation_saliency`: the log-probability of each token of a translation, teacher-forced
  (one row per target position), over the source tokens.
* :func:`next_token_saliency`: the log-probability of one next token of a causal language model,
  over the text's tokens.
* :func:`cosine_saliency`: the cosine similarity of two sentences' mean-pooled encoder embeddings,
  over each sentence's tokens.

The gradients flow through the same modules the model runs (fused attention included); the
embedding's output is swapped for a leaf tensor by a forward hook (:class:`EmbeddingTap`) and
:func:`torch.autograd.grad` differentiates the output with respect to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:  # qkv.pretrained imports the tokenizers library: only where an encoder is explained
    from qkv.models.causal_lm import CausalLM
    from qkv.models.transformer import Transformer
    from qkv.pretrained import BertEncoder, EncodedBatch

SIGNIFICANT_DIGITS = 4
# a number, or nested lists of numbers (a tensor's tolist())
Nested: TypeAlias = "float | list[Nested]"


class EmbeddingTap:
    """While active, each call of ``embedding`` returns a fresh leaf tensor that requires grad
    (its output, detached); the leaves are kept in ``leaves``, in call order.

    Args:
        embedding: the token embedding module (e.g. ``model.src_embed.embedding``).
    """

    def __init__(self, embedding: nn.Module) -> None:
        self.embedding = embedding
        self.leaves: list[Tensor] = []
        self._handle: RemovableHandle | None = None

    def _hook(self, module: nn.Module, args: tuple[object, ...], output: Tensor) -> Tensor:
        leaf = output.detach().requires_grad_(True)
        self.leaves.append(leaf)
        return leaf

    def __enter__(self) -> EmbeddingTap:
        self._handle = self.embedding.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def gradient_x_input(output: Tensor, embeddings: Tensor, *, retain_graph: bool = False) -> Tensor:
    """``sum_d e_d * d output / d e_d`` for every token.

    Args:
        output: a scalar computed from ``embeddings``.
        embeddings: ``(..., s, d)`` leaf tensor from :class:`EmbeddingTap`.
        retain_graph: keep the graph for another output.

    Returns:
        ``(..., s)`` detached scores.
    """
    (grad,) = torch.autograd.grad(output, embeddings, retain_graph=retain_graph)
    return (grad * embeddings).sum(-1).detach()


def _log_probs(logits: Tensor) -> Tensor:
    """log-softmax over the vocabulary in at least float32 (float64 stays float64)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def translation_saliency(model: Transformer, src: Tensor, tgt_in: Tensor, predicted: Sequence[int]) -> Tensor:
    """Saliency of each teacher-forced target token over the source tokens.

    Args:
        model: a :class:`~qkv.Transformer` (in eval mode).
        src: ``(1, s_src)`` source ids.
        tgt_in: ``(1, s_t)`` decoder input ids (BOS then the target).
        predicted: ``s_t`` ids, the token each decoder position predicts (the target shifted by
            one, ending with EOS).

    Returns:
        ``(s_t, s_src)`` scores: row ``t`` is the gradient x input of ``log p(predicted[t] | ...)``.
    """
    if len(predicted) != tgt_in.size(1):
        raise ValueError(f"{len(predicted)} predicted tokens for {tgt_in.size(1)} decoder positions")
    with torch.enable_grad():
        with EmbeddingTap(model.src_embed.embedding) as tap:  # the source side only, even with shared tables
            memory = model.encode(src)
        (embeddings,) = tap.leaves  # (1, s_src, d)
        logits = model.decode(tgt_in, memory).logits
        assert logits is not None  # decode projects to the vocabulary unless asked not to
        log_probs = _log_probs(logits[0])  # (s_t, V)
        positions = torch.arange(len(predicted), device=log_probs.device)
        picked = log_probs[positions, torch.tensor(list(predicted), device=log_probs.device)]  # (s_t,)
        rows = [
            gradient_x_input(picked[t], embeddings, retain_graph=t + 1 < len(predicted))[0]
            for t in range(len(predicted))
        ]
    return torch.stack(rows)  # (s_t, s_src)


def next_token_saliency(model: CausalLM, ids: Tensor, next_id: int) -> Tensor:
    """Saliency of one next token of a :class:`~qkv.CausalLM` over the text's tokens.

    Args:
        model: the language model (in eval mode).
        ids: ``(1, s)`` token ids (within the model's context).
        next_id: the token whose log-probability after the text is explained.

    Returns:
        ``(s,)`` scores.
    """
    with torch.enable_grad():
        with EmbeddingTap(model.token_embedding) as tap:
            logits = model(ids).logits  # (1, s, V)
        (embeddings,) = tap.leaves
        output = _log_probs(logits[0, -1])[int(next_id)]
        return gradient_x_input(output, embeddings)[0]


def cosine_saliency(encoder: BertEncoder, batch_a: EncodedBatch, batch_b: EncodedBatch) -> tuple[Tensor, Tensor, float]:
    """Saliency of the cosine similarity of two sentences' mean-pooled embeddings (what
    sentence-transformers' all-MiniLM-L6-v2 compares) over each sentence's tokens.

    Args:
        encoder: a :class:`~qkv.pretrained.BertEncoder` (in eval mode).
        batch_a: the first sentence from ``encoder.tokenizer([text])`` (one sentence, no padding).
        batch_b: the second sentence, likewise.

    Returns:
        ``(s_a,)`` scores, ``(s_b,)`` scores and the cosine similarity.
    """
    from qkv.pretrained import mean_pool

    with torch.enable_grad():
        with EmbeddingTap(encoder.embeddings.word_embeddings) as tap:
            pooled = []
            for batch in (batch_a, batch_b):
                hidden = encoder(batch.input_ids, batch.attention_mask, batch.token_type_ids).last_hidden_state
                pooled.append(mean_pool(hidden, batch.attention_mask))  # (1, d)
        emb_a, emb_b = tap.leaves  # (1, s_a, d), (1, s_b, d)
        cosine = torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=-1)[0]
        grad_a, grad_b = torch.autograd.grad(cosine, [emb_a, emb_b])
    return (grad_a * emb_a).sum(-1)[0].detach(), (grad_b * emb_b).sum(-1)[0].detach(), float(cosine.detach())


def significant(values: Tensor | Nested, digits: int = SIGNIFICANT_DIGITS) -> Nested:
    """Nested lists of floats rounded to ``digits`` significant digits (scores can be tiny)."""
    if isinstance(values, Tensor):
        values = values.tolist()
    if isinstance(values, list):
        return [significant(v, digits) for v in values]
    return float(f"{float(values):.{digits}g}")


def saliency_field(
    *, about: str, inputs: Sequence[str], outputs: Sequence[str], scores: Tensor, attention: Tensor
) -> dict[str, object]:
    """An example's ``saliency`` field (see :mod:`qkv.viz.export`).

    Args:
        about: what the outputs are, e.g. ``"log-probability of the next token"``.
        inputs: the input tokens (columns).
        outputs: one label per output (rows).
        scores: ``(n_out, n_in)`` gradient x input scores (4 significant digits are kept).
        attention: ``(n_out, n_in)`` the attention weights of the same outputs (4 decimals kept).

    Raises:
        ValueError: the shapes disagree with the labels.
    """
    shape = (len(outputs), len(inputs))
    for name, value in (("scores", scores), ("attention", attention)):
        if tuple(value.shape) != shape:
            raise ValueError(f"saliency {name} is {tuple(value.shape)}; expected (outputs, inputs) = {shape}")
    return {
        "about": about,
        "inputs": list(inputs),
        "outputs": list(outputs),
        "scores": significant(scores.double()),
        "attention": attention.double().round(decimals=4).tolist(),
    }
