"""Decoding speed, side by side: qkv's greedy and beam search with and without the KV cache, and
Hugging Face ``generate`` on a MarianMT model of the same size.

Both models have random weights, so EOS would come at random places. To make every contender do
the same number of decoder steps, every sentence is forced to ``new_tokens`` tokens: qkv's
decoders get an EOS id no token can have (-1) and a length limit of exactly ``new_tokens``;
``generate`` gets ``min_new_tokens = max_new_tokens = new_tokens`` (it masks EOS until then). The
sources are real sentences cut to one length, so no padding differs between contenders.

Contenders: ``qkv_greedy``, ``qkv_greedy_nocache``, ``hf_greedy``, ``qkv_beam``,
``qkv_beam_nocache``, ``hf_beam`` (beam size ``beam_size``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from qkv.bench.competitors import build_marian
from qkv.bench.data import BenchData
from qkv.bench.timing import Timing, ratio, time_interleaved
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runtime.precision import autocast_context

if TYPE_CHECKING:
    from qkv.decoding.search import Hypothesis

logger = logging.getLogger(__name__)

# what one decoding call returns: qkv's token lists (or beam hypotheses), or generate's (b, 1 + new) ids
Decoded: TypeAlias = "torch.Tensor | list[list[int]] | list[list[Hypothesis]]"


def fixed_length_sources(data: BenchData, *, batch_size: int, src_len: int) -> torch.Tensor:
    """``(batch_size, src_len)`` source ids: sentences with at least ``src_len - 1`` tokens, cut
    there, then EOS; no padding. Raises ValueError when too few sentences are long enough."""
    if src_len < 2:
        raise ValueError(f"src_len must be >= 2, got {src_len}")
    long_enough = [s[: src_len - 1] + [data.eos_id] for s in data.sources if len(s) >= src_len - 1]
    if len(long_enough) < batch_size:
        raise ValueError(
            f"only {len(long_enough)} source sentences have >= {src_len - 1} tokens, need batch_size={batch_size}"
        )
    return torch.tensor(long_enough[:batch_size], dtype=torch.long)  # (b, src_len)


def decoding_benchmark(
    data: BenchData,
    config: TransformerConfig,
    *,
    device: torch.device,
    batch_size: int = 16,
    src_len: int = 16,
    new_tokens: int = 64,
    beam_size: int = 5,
    repeats: int = 5,
    warmup: int = 1,
    bf16: bool = False,
    include_hf: bool = True,
    include_nocache: bool = True,
) -> dict[str, Any]:
    """Time greedy and beam decoding of ``new_tokens`` tokens for one batch, interleaved.

    Args:
        data: supplies the source sentences and special ids.
        config: the model sizes (qkv and Marian alike); ``max_len`` must exceed ``new_tokens``.
        device: where to decode.
        batch_size: sentences decoded together (beam search decodes ``batch_size * beam_size`` rows).
        src_len: source length (every sentence cut to it).
        new_tokens: tokens generated per sentence (at least ``src_len``).
        beam_size: beam width of the beam-search contenders.
        repeats, warmup: see :func:`qkv.bench.timing.time_interleaved`.
        bf16: decode under bfloat16 autocast.
        include_hf: time Hugging Face ``generate`` (needs transformers).
        include_nocache: time qkv without the KV cache (recomputes the prefix every step).

    Returns:
        ``{"config", "contenders": {name: timing and tokens generated}, "ratios"}``.
    """
    if new_tokens < src_len or new_tokens >= config.max_len:
        raise ValueError(f"need src_len <= new_tokens < max_len, got {src_len}, {new_tokens}, {config.max_len}")
    src = fixed_length_sources(data, batch_size=batch_size, src_len=src_len).to(device)
    contenders = _qkv_contenders(
        data, config, src, device=device, new_tokens=new_tokens, beam_size=beam_size, bf16=bf16
    )
    if not include_nocache:
        contenders = {name: call for name, call in contenders.items() if not name.endswith("_nocache")}
    if include_hf:
        try:
            contenders |= _hf_contenders(
                data, config, src, device=device, new_tokens=new_tokens, beam_size=beam_size, bf16=bf16
            )
        except (ImportError, ValueError) as err:
            logger.warning("Hugging Face contenders left out: %s", err)
    generated = {name: _generated_lengths(call()) for name, call in contenders.items()}  # also a warm-up
    for name, lengths in generated.items():
        if set(lengths) != {new_tokens}:
            logger.warning("%s generated %s tokens, expected %d each", name, sorted(set(lengths)), new_tokens)
    timings = time_interleaved(contenders, device=device, repeats=repeats, warmup=warmup)
    results = {
        name: {
            **t.as_dict(),
            "tokens_per_sentence": sorted(set(generated[name])),
            "tokens_per_s": batch_size * new_tokens / t.median if t.median else None,
        }
        for name, t in timings.items()
    }
    config_out = dict(
        device=str(device),
        batch_size=batch_size,
        src_len=src_len,
        new_tokens=new_tokens,
        beam_size=beam_size,
        bf16=bf16,
        repeats=repeats,
        warmup=warmup,
        d_model=config.d_model,
        layers=[config.num_encoder_layers, config.num_decoder_layers],
        heads=config.num_heads,
        d_ff=config.d_ff,
        vocab=config.tgt_vocab_size,
    )
    return {"config": config_out, "data": data.description, "contenders": results, "ratios": _ratios(timings)}


def _ratios(timings: dict[str, Timing]) -> dict[str, float | None]:
    """The speed-ups the targets are about: the KV cache's, and qkv's over Hugging Face's."""
    med = {name: t.median for name, t in timings.items()}
    return {
        "greedy_cache_speedup": ratio(med.get("qkv_greedy_nocache"), med.get("qkv_greedy")),  # target >= 3
        "beam_cache_speedup": ratio(med.get("qkv_beam_nocache"), med.get("qkv_beam")),
        "qkv_greedy_vs_hf_greedy": ratio(med.get("hf_greedy"), med.get("qkv_greedy")),  # > 1: qkv faster
        "qkv_beam_vs_hf_beam": ratio(med.get("hf_beam"), med.get("qkv_beam")),  # target >= 1
    }


def _qkv_contenders(
    data: BenchData,
    config: TransformerConfig,
    src: torch.Tensor,
    *,
    device: torch.device,
    new_tokens: int,
    beam_size: int,
    bf16: bool,
) -> dict[str, Callable[[], Decoded]]:
    """qkv's greedy and beam search, with and without the KV cache, on a new random model."""
    from qkv.decoding.search import beam_search, greedy_decode
    from qkv.decoding.steps import for_decoding

    qkv_model = Transformer(config).to(device).eval()
    # the fast path's weights packed once, as a long-lived caller keeps them, not in every timed call
    # (under bf16 autocast the model decodes itself)
    prepared = qkv_model if bf16 else for_decoding(qkv_model)
    never = -1  # an EOS id no token has: every sentence runs to its length limit
    extra = new_tokens - src.size(1)  # qkv's limit is source length + extra_len

    def qkv_call(beam: int, use_cache: bool) -> Callable[[], Decoded]:
        decoder = prepared if use_cache else qkv_model

        def call() -> Decoded:
            with autocast_context(device, bf16):
                if beam == 1:
                    return greedy_decode(
                        decoder, src, bos_id=data.bos_id, eos_id=never, extra_len=extra, use_cache=use_cache
                    )
                return beam_search(
                    decoder,
                    src,
                    bos_id=data.bos_id,
                    eos_id=never,
                    beam_size=beam,
                    extra_len=extra,
                    use_cache=use_cache,
                )

        return call

    return {
        "qkv_greedy": qkv_call(1, True),
        "qkv_greedy_nocache": qkv_call(1, False),
        "qkv_beam": qkv_call(beam_size, True),
        "qkv_beam_nocache": qkv_call(beam_size, False),
    }


def _hf_contenders(
    data: BenchData,
    config: TransformerConfig,
    src: torch.Tensor,
    *,
    device: torch.device,
    new_tokens: int,
    beam_size: int,
    bf16: bool,
) -> dict[str, Callable[[], Decoded]]:
    """Hugging Face ``generate``, greedy and beam, on a new random MarianMT model of ``config``'s
    sizes. Raises ImportError or ValueError where transformers is missing."""
    marian = build_marian(config, bos_id=data.bos_id, eos_id=data.eos_id).to(device).eval().model
    attention_mask = torch.ones_like(src)

    def hf_call(beam: int) -> Callable[[], Decoded]:
        def call() -> Decoded:
            with torch.no_grad(), autocast_context(device, bf16):
                ids = marian.generate(
                    input_ids=src,
                    attention_mask=attention_mask,
                    num_beams=beam,
                    do_sample=False,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    use_cache=True,
                    length_penalty=0.6 if beam > 1 else 1.0,
                    early_stopping=False,
                )
            assert isinstance(ids, torch.Tensor)  # not return_dict_in_generate: the ids alone
            return ids

        return call

    return {"hf_greedy": hf_call(1), "hf_beam": hf_call(beam_size)}


def _generated_lengths(output: Decoded) -> list[int]:
    """Tokens generated per sentence: qkv returns lists of ids; ``generate`` returns
    ``(b, 1 + new)`` ids starting with the decoder start token."""
    if isinstance(output, torch.Tensor):
        return [output.size(1) - 1] * output.size(0)
    return [len(tokens) for tokens in output]


def plot_decoding(report: dict[str, Any], path: str | Path) -> None:
    """Bars of generated tokens/s per contender."""
    from qkv.bench.plots import bar_chart

    values = {n: r["tokens_per_s"] for n, r in report["contenders"].items() if r["tokens_per_s"]}
    c = report["config"]
    bar_chart(
        values,
        path,
        ylabel="generated tokens / s (higher is better)",
        title=f"decoding {c['new_tokens']} tokens, batch {c['batch_size']}, beam {c['beam_size']}",
    )
