"""``qkv export RUN --to ctranslate2 OUT`` for a language-model run: a CTranslate2 ``Generator`` folder.

The model is described with CTranslate2's decoder-only specification
(``TransformerDecoderModelSpec``) filled with the run's weights, as the translation export
(:mod:`qkv.export.ctranslate2`) fills its encoder-decoder one; the parts of today's models map to
the spec's own options: RMSNorm (``rms_norm``), a gated feed-forward (``ffn_glu``: CTranslate2's
``linear_0`` is qkv's gate, ``linear_0_noact`` its up product ``linear1``), rotary positions
(``rotary_dim``, HF's "rotate_half" layout: ``rotary_interleave=False``; linear scaling),
ALiBi, grouped-query heads (``num_heads_kv``), a sliding window per layer (0 on a layer without),
QK-norm and logit soft-capping. A learned or sinusoidal table is written as it is. Anything the
spec cannot hold exactly is refused in one line naming the field (:func:`ct2_lm_refusal`).

The folder holds CTranslate2's files (``vocabulary.json``: the string of each qkv id), the run's
``tokenizer.json`` and :data:`MANIFEST` (context, vocabulary size, tokenizer kind). Every float32
folder is reloaded and checked before it is put in place: teacher-forced log-probabilities against
qkv's, and greedy generation (``Generator.generate_batch`` with ``sampling_topk=1``) against
:meth:`~qkv.models.causal_lm.CausalLM.generate` with ``temperature=0``, up to near-ties
(:func:`same_up_to_ties`).

A sliding window is exact in CTranslate2's decoding loop, one token at a time (``generate_batch``'s
default ``include_prompt_in_result=True``), not where it forwards several tokens at once
(``include_prompt_in_result=False`` with a prompt longer than the window, ``score_batch``): measured.

CTranslate2 has no counterpart of one thing qkv's generation does: once a sequence fills the
context, qkv re-reads its last ``context`` tokens at moved positions; CTranslate2 keeps going (and a
position table runs out). Greedy generations agree while prompt and continuation fit the context.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from qkv.data.text import CharTokenizer
from qkv.data.tokenizer import SPECIALS, Tokenizer
from qkv.export.ctranslate2 import QUANTIZATIONS, as_numpy, check_output_folder, set_linear, set_norm
from qkv.export.output import building_export
from qkv.inference.ctranslate2 import vocabulary
from qkv.inference.kinds import CAUSAL_LM
from qkv.inference.runs import load_run
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.runtime.fileio import write_json

MANIFEST = "qkv_ct2_lm.json"  # not the translation export's qkv_ct2.json: a Ct2Translator must not read it
MANIFEST_FORMAT = 1
CHECK_TOL = 1e-4  # float32 log-probabilities of the saved folder vs qkv's (same function, other kernels)
CHECK_PROMPTS = 8  # prompts of the greedy check an export runs on its folder
CHECK_NEW_TOKENS = 12
# a greedy step whose two best logits are closer than this is a tie that another library's rounding
# may break the other way: generations may part there without the models differing
TIE_MARGIN = 1e-4
NO_TOKEN = "<qkv_none>"  # CTranslate2's bos/eos/unk for a vocabulary without them (a character one)
# qkv activation -> (CTranslate2 activation name, gated); relu2 (ReLU squared) has none
CT2_ACTIVATIONS = {
    "relu": ("RELU", False),
    "gelu": ("GELU", False),  # erf GELU, as torch's default
    "gelu_tanh": ("GELUTanh", False),
    "silu": ("SWISH", False),
    "swiglu": ("SWISH", True),
    "geglu": ("GELU", True),
}

__all__ = [
    "MANIFEST",
    "build_lm_spec",
    "ct2_lm_refusal",
    "export_ctranslate2_lm",
    "generate_greedy",
    "lm_vocabulary",
    "same_up_to_ties",
    "write_lm_model",
]


def ct2_lm_refusal(config: CausalLMConfig) -> str | None:
    """Why ``config`` has no exact CTranslate2 decoder-only counterpart, or None when it has one.

    Args:
        config: the language model's config.

    Returns:
        A clause naming the field, or None.
    """
    if config.activation not in CT2_ACTIVATIONS:
        return f"activation={config.activation!r}: CTranslate2 has no activation of that name"
    if config.positional == "rotary" and config.rotary_scaling == "llama3":
        return "rotary_scaling='llama3': CTranslate2's decoder leaves these frequencies unscaled (measured)"
    return None


def _rotary_options(config: CausalLMConfig) -> dict[str, Any]:
    """The spec's rotary arguments: the rotated dims, HF's half-split layout, base and linear scaling."""
    from ctranslate2.specs.attention_spec import RotaryScalingType

    rotary = config.rotary()
    if rotary is None:
        return {}
    options: dict[str, Any] = dict(
        rotary_dim=rotary.rotated,  # int(head_dim * fraction), the first dims, as qkv rotates
        rotary_interleave=False,  # qkv rotates as HF's rotate_half: the first half pairs with the second
        rotary_base=config.rotary_base,
    )
    if config.rotary_scaling == "linear":  # llama3 is refused (ct2_lm_refusal)
        options.update(rotary_scaling_type=RotaryScalingType.Linear, rotary_scaling_factor=config.rotary_scaling_factor)
    return options


def _positions(model: CausalLM) -> np.ndarray:
    """The table the embedding adds: qkv's sinusoids as qkv lays them out, a learned table, or zeros."""
    config, positional = model.config, cast(Any, model.positional)
    if config.positional == "sinusoidal":
        return as_numpy(positional.table)
    if config.positional == "learned":
        return as_numpy(positional.embedding.weight)
    return np.zeros((config.context, config.d_model), dtype=np.float32)  # "none": adds nothing


def build_lm_spec(model: CausalLM) -> Any:
    """A CTranslate2 ``TransformerDecoderModelSpec`` computing what ``model`` computes (weights
    filled, no vocabulary).

    Args:
        model: the language model, float32.

    Returns:
        The spec.

    Raises:
        ValueError: the configuration has no exact counterpart (one line naming the field).
    """
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    reason = ct2_lm_refusal(config)
    if reason is not None:
        raise ValueError(f"cannot export to CTranslate2: {reason}")
    activation, gated = CT2_ACTIVATIONS[config.activation]
    windows = [config.window(i) for i in range(config.num_layers)]
    spec = transformer_spec.TransformerDecoderModelSpec.from_config(
        config.num_layers,
        config.num_heads,
        pre_norm=config.norm_first,
        activation=getattr(common_spec.Activation, activation),
        ffn_glu=gated,
        rms_norm=config.norm == "rms",
        alibi=config.positional == "alibi",
        num_heads_kv=config.num_kv_heads,
        sliding_window=max((w for w in windows if w is not None), default=None),
        qk_norm=config.qk_norm,
        **_rotary_options(config),
    )
    decoder = spec.decoder
    decoder.scale_embeddings = config.scale_embedding
    decoder.embeddings.weight = as_numpy(model.token_embedding.weight)
    decoder.projection.weight = as_numpy(model.output_proj.weight)  # qkv's output projection has no bias
    if config.positional in ("learned", "sinusoidal", "none"):
        decoder.position_encodings.encodings = _positions(model)
    if config.logit_softcap is not None:
        decoder.final_logit_softcapping = np.dtype("float32").type(config.logit_softcap)
    if config.norm_first:  # pre-norm stacks end with a norm, as CTranslate2's pre_norm does
        set_norm(decoder.layer_norm, model.decoder.norm)
    layers: list[Any] = list(model.decoder.layers)  # EncoderLayer modules (their sub-modules typed loosely)
    for i, (layer_spec, layer) in enumerate(zip(decoder.layer, layers, strict=True)):
        attn, ff = layer.self_attn, layer.feed_forward
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = torch.cat([p.bias for p in projs]) if attn.q_proj.bias is not None else None
        set_linear(layer_spec.self_attention.linear[0], torch.cat([p.weight for p in projs]), bias)
        set_linear(layer_spec.self_attention.linear[1], attn.out_proj.weight, attn.out_proj.bias)
        set_norm(layer_spec.self_attention.layer_norm, layer.norm1)
        if config.qk_norm:
            if config.norm == "layer":  # the spec's QK-norm is RMSNorm unless given a LayerNorm's (with beta)
                layer_spec.self_attention.q_norm = common_spec.LayerNormSpec(rms_norm=False)
                layer_spec.self_attention.k_norm = common_spec.LayerNormSpec(rms_norm=False)
            set_norm(layer_spec.self_attention.q_norm, attn.q_norm)
            set_norm(layer_spec.self_attention.k_norm, attn.k_norm)
        if config.sliding_window is not None:  # per layer: 0 is a layer that sees every earlier token
            layer_spec.self_attention.sliding_window = np.dtype("int32").type(windows[i] or 0)
        if ff.gate is not None:
            set_linear(layer_spec.ffn.linear_0, ff.gate.weight, ff.gate.bias)  # act(x W_gate) ...
            set_linear(layer_spec.ffn.linear_0_noact, ff.linear1.weight, ff.linear1.bias)  # ... * (x W_1)
        else:
            set_linear(layer_spec.ffn.linear_0, ff.linear1.weight, ff.linear1.bias)
        set_linear(layer_spec.ffn.linear_1, ff.linear2.weight, ff.linear2.bias)
        set_norm(layer_spec.ffn.layer_norm, layer.norm2)
    spec.config.layer_norm_epsilon = config.layer_norm_eps
    return spec


def lm_vocabulary(tokenizer: Tokenizer | CharTokenizer, size: int) -> list[str]:
    """One distinct string per model id ``0 .. size - 1``: a BPE tokenizer's token strings, a
    character tokenizer's characters, then placeholders for rows the tokenizer never produces.

    Args:
        tokenizer: the run's tokenizer.
        size: the model's vocabulary size.

    Returns:
        The strings, indexed by id.

    Raises:
        ValueError: the strings are not distinct.
    """
    if isinstance(tokenizer, Tokenizer):
        return vocabulary(tokenizer, size)
    tokens = list(tokenizer.chars[:size]) + [f"<qkv_unused_{i}>" for i in range(tokenizer.vocab_size, size)]
    if len(set(tokens)) != size or NO_TOKEN in tokens:
        raise ValueError(f"the tokenizer's characters are not distinct strings ({len(set(tokens))} of {size})")
    return tokens


def write_lm_model(
    model: CausalLM, tokenizer: Tokenizer | CharTokenizer, folder: Path, *, quantization: str = "float32"
) -> list[str]:
    """Save ``model`` (float32, eval mode) into ``folder`` with CTranslate2, and :data:`MANIFEST`;
    the caller adds ``tokenizer.json``.

    Args:
        model: the language model.
        tokenizer: the run's tokenizer.
        folder: an existing, empty folder.
        quantization: the stored weight type, one of :data:`~qkv.export.ctranslate2.QUANTIZATIONS`.

    Returns:
        The vocabulary written (the string of each id).
    """
    spec = build_lm_spec(model)
    tokens = lm_vocabulary(tokenizer, model.config.vocab_size)
    if isinstance(tokenizer, Tokenizer):
        _, bos, eos, unk = SPECIALS
        spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = unk, bos, eos
    else:  # a character vocabulary has no special tokens; none of these strings is in it
        spec.config.unk_token = spec.config.bos_token = spec.config.eos_token = NO_TOKEN
    spec.register_vocabulary(tokens)
    spec.validate()
    spec.optimize(quantization=None if quantization == "float32" else quantization)
    spec.save(str(folder))
    manifest = {
        "qkv_ct2_lm": MANIFEST_FORMAT,
        "quantization": quantization,
        "context": model.config.context,
        "vocab_size": model.config.vocab_size,
        "tokenizer": "bpe" if isinstance(tokenizer, Tokenizer) else "char",
    }
    write_json(folder / MANIFEST, manifest)
    return tokens


def generate_greedy(
    generator: Any, tokens: Sequence[str], prompts: Sequence[Sequence[int]], new: int
) -> list[list[int]]:
    """The ids of the ``new`` tokens CTranslate2's greedy search adds to each prompt (it never
    stops at an end token: qkv's generation does not).

    The prompt goes through CTranslate2's decoding loop one token at a time
    (``include_prompt_in_result=True``, its default): forwarded at once, a prompt longer than a
    sliding window is attended over wrongly by CTranslate2 (measured), one token at a time it is exact.

    Args:
        generator: a ``ctranslate2.Generator``.
        tokens: the folder's vocabulary (id -> string).
        prompts: token ids, at least one each.
        new: tokens to add.

    Returns:
        The new ids of each prompt, in the order given.
    """
    out: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    for length, rows in by_length.items():  # one batch per prompt length: max_length counts the prompt
        results = generator.generate_batch(
            [[tokens[t] for t in prompts[i]] for i in rows],
            beam_size=1,
            sampling_topk=1,
            max_length=length - 1 + new,  # the tokens after the first one
            min_length=length - 1 + new,
            end_token=[],
            include_prompt_in_result=True,
        )
        for i, result in zip(rows, results, strict=True):
            out[i] = list(result.sequences_ids[0][length:])
    return out


def check_lm_folder(model: CausalLM, tokens: Sequence[str], folder: Path, *, quantization: str) -> float:
    """A float32 folder must score as ``model`` does (teacher-forced log-probabilities within
    :data:`CHECK_TOL`) and generate what it generates greedily on :data:`CHECK_PROMPTS` fixed prompts
    (prompt and continuation longer than a sliding window, so that the window matters); a quantized
    one computes something else by design, so it must load and generate.

    CTranslate2's ``score_batch`` forwards a sequence at once, which it gets wrong past a sliding
    window (see :func:`generate_greedy`): a windowed model is scored on sequences of the window's
    length, and the window itself checked by the greedy generations.

    Args:
        model: the language model.
        tokens: the folder's vocabulary.
        folder: the saved folder.
        quantization: its stored weight type.

    Returns:
        The largest log-probability difference (0 for a quantized folder).

    Raises:
        ValueError: the folder differs from the run's model.
    """
    import ctranslate2

    generator = ctranslate2.Generator(str(folder), device="cpu")
    config = model.config
    gen = torch.Generator().manual_seed(0)
    window = config.sliding_window
    prompt_len = min(config.context - 1, 4 if window is None else window + 1)
    new = min(CHECK_NEW_TOKENS + (window or 0), config.context - prompt_len)
    prompts = torch.randint(0, config.vocab_size, (CHECK_PROMPTS, prompt_len), generator=gen)
    if quantization != "float32":
        generate_greedy(generator, tokens, prompts[:2].tolist(), 2)
        return 0.0
    length = min(config.context, 16 if window is None else max(2, window))
    ids = torch.randint(0, config.vocab_size, (2, length), generator=gen)
    result = generator.score_batch([[tokens[i] for i in row] for row in ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits
        assert logits is not None  # projected by default
        logprobs = torch.log_softmax(logits.float(), dim=-1)[:, :-1]  # (2, length - 1): each next token
        expected = model.generate(prompts, new, temperature=0)[:, prompt_len:].tolist()
    ours = logprobs.gather(-1, ids[:, 1:, None])[..., 0]
    theirs = torch.tensor([r.log_probs for r in result])
    worst = float((ours - theirs).abs().max())
    if not worst <= CHECK_TOL:  # NaN fails too
        raise ValueError(f"the CTranslate2 model differs from the run by {worst:.2e} (> {CHECK_TOL}); nothing written")
    got = generate_greedy(generator, tokens, prompts.tolist(), new)
    for prompt, mine, other in zip(prompts.tolist(), expected, got, strict=True):
        if not same_up_to_ties(model, prompt, mine, other):
            raise ValueError("the CTranslate2 model's greedy generations differ from the run's; nothing written")
    return worst


def same_up_to_ties(model: CausalLM, prompt: list[int], mine: list[int], theirs: list[int]) -> bool:
    """Whether two greedy continuations of ``prompt`` are the same, or first part where ``model``'s
    two best logits are within :data:`TIE_MARGIN` (a tie another library's rounding may break the
    other way, not a different model).

    Args:
        model: the language model.
        prompt: the prompt's ids.
        mine: qkv's continuation.
        theirs: the other library's.

    Returns:
        True when they agree up to a tie.
    """
    if mine == theirs:
        return True
    step = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + mine[:step]])).logits
    assert logits is not None  # projected by default
    best = logits[0, -1].float().topk(2).values
    return float(best[0] - best[1]) <= TIE_MARGIN


def export_ctranslate2_lm(
    run_dir: str | Path,
    out: str | Path,
    *,
    weights: str = "model",
    quantization: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Export a language-model run as a CTranslate2 ``Generator`` folder.

    Args:
        run_dir: a language-model run folder.
        out: the folder to write: must not exist or be empty, unless ``overwrite`` replaces an earlier export.
        weights: which of the run's weights: ``model`` (averaged/final), ``best``, ``last`` or ``ema``.
        quantization: the stored weight type, one of :data:`~qkv.export.ctranslate2.QUANTIZATIONS`
            (float32 is exact; int8 is smaller and faster, and its generations may differ).
        overwrite: replace an earlier CTranslate2 export at ``out`` (never anything else).

    Returns:
        ``out``.

    Raises:
        ValueError: a translation run, a configuration without a counterpart, or ``out`` is taken.
        PermissionError: ``out`` cannot be written (checked before any work).
        FileNotFoundError: ``run_dir`` is not a run folder, or lacks the weights.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    out = Path(out)
    target = check_output_folder(out, overwrite=overwrite, run_dir=run_dir)
    model, tokenizer, _ = load_run(run_dir, weights, task=CAUSAL_LM.name)
    assert isinstance(model, CausalLM)  # a language-model run's, load_run checked
    model = model.float().eval()
    reason = ct2_lm_refusal(model.config)
    if reason is not None:  # before any folder is made
        raise ValueError(f"cannot export to CTranslate2: {reason}")
    with building_export(target, kind="ctranslate2", tag="ct2") as tmp:
        tokens = write_lm_model(model, tokenizer, tmp, quantization=quantization)
        shutil.copyfile(Path(run_dir) / "tokenizer.json", tmp / "tokenizer.json")
        check_lm_folder(model, tokens, tmp, quantization=quantization)
    return out
