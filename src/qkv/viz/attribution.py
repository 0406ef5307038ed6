"""What each generated token was attributed to, step by step: gradient x input and attention rollout.

For generated token ``t`` (chosen after the prompt and the ``t`` tokens generated before it):

* **gradient x input**: ``sum_d e_jd * d log p(token_t) / d e_jd`` for each context token ``j``,
  where ``e_j`` is token ``j``'s row of the token embedding table (before positions are added or any
  scaling) and ``log p`` the log-softmax of the logits that chose the token: the signed dot
  product of the embedding and the gradient, no norm taken (positive: the token raised the chosen
  token's log-probability; :func:`qkv.viz.saliency.gradient_x_input`, the existing saliency's
  convention).
* **rollout**: the row of the position that chose token ``t`` in the attention rollout through
  every layer (Abnar & Zuidema 2020; :func:`qkv.viz.analysis.rollout`, the rollout view's own):
  non-negative, summing to 1 over the context.

A language model (:func:`causal_lm_attribution`) continues the text greedily by up to
:data:`NEW_TOKENS` tokens (as far as its context allows) and each step's context is the prompt and
the tokens generated before it. A causal model's position ``i`` sees only positions up to ``i``, so
one teacher-forced forward pass over the prompt and the generated tokens gives every step's
log-probability and gradients (one backward pass each), and one more, with the weights, every
step's rollout row. A translation
(:func:`translation_attribution`) attributes each target token to the source: its gradient x input
is the saliency view's (:func:`qkv.viz.saliency.translation_saliency`) and its rollout the
cross-attention's last layer through the encoder's rollout (:func:`qkv.viz.analysis.cross_rollout`).

An example's ``attribution`` field (checked by :func:`check_attribution`)::

    {"about": str, "prompt": [str], "generated": [str],
     "steps": [{"prob": float, "context": int, "scores": [context] floats, "rollout": [context] floats}]}

one step per generated token; step ``t``'s context is the first ``context`` tokens of
``prompt + generated`` (``len(prompt) <= context <= len(prompt) + t``). Scores keep 4 significant
digits, rollout weights and probabilities 4 too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn, Protocol

import torch
from torch import Tensor

from qkv.viz.analysis import cross_rollout, rollout
from qkv.viz.lens import Labeler, causal_lm_lens, check_lens, decoder_lens
from qkv.viz.saliency import EmbeddingTap, gradient_x_input, significant

if TYPE_CHECKING:
    from qkv.models.causal_lm import CausalLM
    from qkv.models.transformer import Transformer

NEW_TOKENS = 5  # tokens a language model's text is continued by for the attribution view


class View(Protocol):
    """What attribution reads of an attention view (:class:`qkv.viz.export.AttentionView`, which
    imports this module's checks: a protocol, not an import, keeps the two apart)."""

    @property
    def queries(self) -> Sequence[str]:
        """The tokens that attend (rows)."""

    @property
    def keys(self) -> Sequence[str]:
        """The tokens attended to (columns)."""

    @property
    def attentions(self) -> Sequence[Tensor]:
        """One ``(h, s_q, s_k)`` tensor per layer."""


def attribution_field(
    *,
    about: str,
    prompt: Sequence[str],
    generated: Sequence[str],
    probs: Sequence[float],
    scores: Sequence[Tensor],
    rollouts: Sequence[Tensor],
) -> dict[str, object]:
    """An example's ``attribution`` field (layout in the module docstring).

    Args:
        about: what was generated, e.g. ``"greedy continuation"``.
        prompt: the prompt's token labels.
        generated: the generated tokens' labels.
        probs: each generated token's probability.
        scores: per step, ``(context,)`` gradient x input scores.
        rollouts: per step, ``(context,)`` rollout weights.
    """
    if not len(generated) == len(probs) == len(scores) == len(rollouts):
        raise ValueError(f"{len(generated)} tokens, {len(probs)} probabilities, {len(scores)} and {len(rollouts)} rows")
    steps = []
    for p, score, flow in zip(probs, scores, rollouts):
        if score.shape != flow.shape or score.dim() != 1:
            raise ValueError(f"a step's scores {tuple(score.shape)} and rollout {tuple(flow.shape)} differ")
        steps.append(
            {
                "prob": significant(float(p)),
                "context": int(score.numel()),
                "scores": significant(score.double()),
                "rollout": significant(flow.double()),
            }
        )
    return {"about": about, "prompt": list(prompt), "generated": list(generated), "steps": steps}


def causal_lm_attribution(
    model: CausalLM, ids: Tensor, label: Labeler, *, new_tokens: int = NEW_TOKENS
) -> dict[str, object] | None:
    """Continue a text greedily and attribute each new token to the tokens before it.

    Args:
        model: the language model (in eval mode).
        ids: ``(1, s)`` the prompt's ids.
        label: readable labels of token ids.
        new_tokens: the most tokens to generate.

    Returns:
        The ``attribution`` field, or None when the prompt fills the model's context.
    """
    s = ids.size(1)
    n = min(new_tokens, model.config.context - s)
    if n < 1:
        return None
    with torch.no_grad():
        full = model.generate(ids, n, temperature=0.0)  # (1, s + n)
    generated = [int(i) for i in full[0, s:].tolist()]
    inputs = full[:, :-1]  # (1, s + n - 1): position s - 1 + t chooses generated token t
    with torch.no_grad():  # the weights apart from the gradients' pass, which then runs the fused kernel
        weights = model(inputs, need_weights=True, project=False).attentions
    assert weights is not None  # need_weights
    # through every layer; the heads averaged first (rollout's first step), to hold (s, s) per layer only
    flow = rollout([w[0].mean(0, keepdim=True) for w in weights])[-1]  # (s + n - 1, s + n - 1)
    del weights
    with torch.enable_grad(), EmbeddingTap(model.token_embedding) as tap:
        hidden = model(inputs, project=False).hidden
        (embeddings,) = tap.leaves  # (1, s + n - 1, d)
        logits = model.logits(hidden[0, s - 1 :])  # (n, V)
        log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        picked = log_probs[torch.arange(n, device=log_probs.device), torch.tensor(generated, device=log_probs.device)]
        scores = [gradient_x_input(picked[t], embeddings, retain_graph=t + 1 < n)[0, : s + t].cpu() for t in range(n)]
    rows = [flow[s - 1 + t, : s + t] for t in range(n)]
    return attribution_field(
        about=f"greedy continuation ({n} tokens)",
        prompt=label([int(i) for i in ids[0].tolist()]),
        generated=label(generated),
        probs=picked.detach().exp().tolist(),
        scores=scores,
        rollouts=rows,
    )


def translation_attribution(
    *,
    about: str,
    views: Sequence[View],
    scores: Tensor,
    probs: Sequence[float],
) -> dict[str, object]:
    """Attribute each token of a translation to the source tokens.

    Args:
        about: what the target is, e.g. ``"greedy translation"``.
        views: the encoder self-attention, decoder self-attention and cross-attention views
            (:meth:`qkv.viz.Seq2SeqExplorer.views`; the cross-attention's rows are the tokens).
        scores: ``(s_t, s_src)`` gradient x input of each target token
            (:func:`qkv.viz.saliency.translation_saliency`).
        probs: ``s_t`` probabilities of the target tokens.
    """
    encoder, _, cross = views
    flow = cross_rollout(cross.attentions, rollout(encoder.attentions)[-1])[-1]  # (s_t, s_src) last layer
    return attribution_field(
        about=about,
        prompt=encoder.keys,
        generated=cross.queries,
        probs=probs,
        scores=list(scores.detach().cpu()),
        rollouts=list(flow),
    )


def causal_lm_fields(model: CausalLM, ids: Tensor, label: Labeler) -> dict[str, object]:
    """A language model's ``lens`` and ``attribution`` fields for a text (``attribution`` only when
    the text leaves room in the context).

    Args:
        model: the language model (in eval mode).
        ids: ``(1, s)`` the text's ids.
        label: readable labels of token ids.
    """
    fields: dict[str, object] = {"lens": causal_lm_lens(model, ids, label)}
    attribution = causal_lm_attribution(model, ids, label)
    if attribution is not None:
        fields["attribution"] = attribution
    return fields


def seq2seq_fields(
    model: Transformer,
    src: Tensor,
    tgt_in: Tensor,
    predicted: Sequence[int],
    views: Sequence[View],
    scores: Tensor,
    label: Labeler,
    *,
    about: str,
) -> dict[str, object]:
    """A translation's ``lens`` (over the decoder) and ``attribution`` (of each target token to the
    source) fields.

    Args:
        model: the :class:`~qkv.Transformer` (in eval mode).
        src: ``(1, s_src)`` source ids.
        tgt_in: ``(1, s_t)`` decoder input ids.
        predicted: ``s_t`` ids each decoder position predicts.
        views: the example's three attention views.
        scores: ``(s_t, s_src)`` the saliency view's gradient x input scores.
        label: readable labels of target token ids.
        about: what the target is.
    """
    lens = decoder_lens(model, src, tgt_in, predicted, label)
    final = lens["next_probs"]
    assert isinstance(final, list)
    probs = [float(p) for p in final[-1]]  # the model's own probability of each target token
    return {"lens": lens, "attribution": translation_attribution(about=about, views=views, scores=scores, probs=probs)}


def _fail(where: str, message: str) -> NoReturn:
    raise ValueError(f"{where}: {message}")


def _numbers(value: object, n: int, low: float | None = None) -> bool:
    return (
        isinstance(value, list)
        and len(value) == n
        and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and (low is None or x >= low)
            for x in value
        )
    )


def check_attribution(attribution: object, where: str) -> None:
    """Check an example's ``attribution`` field (layout in the module docstring); a one-line
    ValueError naming ``where`` and what is wrong."""
    if not isinstance(attribution, dict):
        _fail(where, "must be an object")
    for key in ("about", "prompt", "generated", "steps"):
        if key not in attribution:
            _fail(where, f"has no {key!r}")
    if not isinstance(attribution["about"], str):
        _fail(where, "'about' must be a string")
    for key in ("prompt", "generated"):
        value = attribution[key]
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            _fail(where, f"{key!r} must be a list of strings")
    prompt, steps = len(attribution["prompt"]), attribution["steps"]
    if not isinstance(steps, list) or len(steps) != len(attribution["generated"]):
        _fail(where, f"'steps' must be a list of {len(attribution['generated'])} steps (one per generated token)")
    for t, step in enumerate(steps):
        context = step.get("context") if isinstance(step, dict) else None
        if not isinstance(context, int) or isinstance(context, bool) or not prompt <= context <= prompt + t:
            _fail(where, f"step {t}: 'context' must be an integer from {prompt} to {prompt + t}")
        if not _numbers([step.get("prob")], 1, 0.0) or step["prob"] > 1:
            _fail(where, f"step {t}: 'prob' must be a probability")
        if not _numbers(step.get("scores"), context):
            _fail(where, f"step {t}: 'scores' must be {context} numbers")
        if not _numbers(step.get("rollout"), context, 0.0):
            _fail(where, f"step {t}: 'rollout' must be {context} non-negative numbers")


def check_fields(example: dict, where: str) -> None:
    """Check an example's optional ``lens`` and ``attribution`` fields, where present
    (:func:`qkv.viz.lens.check_lens`, :func:`check_attribution`)."""
    if "lens" in example:
        check_lens(example["lens"], f"{where} 'lens'")
    if "attribution" in example:
        check_attribution(example["attribution"], f"{where} 'attribution'")
