"""How a run decodes by default, and how a recipe's tokens per step are split among processes and
batches: the parts of a recipe that are computed rather than read (re-exported by :mod:`qkv.runs.recipes`)."""

from __future__ import annotations

from typing import Any

# How a translation run decodes when qkv evaluate / translate get no --beam / --alpha: a recipe's
# "decode" (stored in the run's config.json when it starts), else this.
DEFAULT_DECODE: dict[str, Any] = {"beam_size": 5, "alpha": 0.6}
MAX_SAVED_BEAM = 100  # as qkv translate --beam: beam search holds that many copies of each sentence

# the largest batch one process takes at once (padded tokens) before it accumulates several. What
# backward keeps of such a batch under bf16 autocast, counted with torch.autograd.graph's
# saved_tensors_hooks for 30-token sentences at 1,200 and 2,400 tokens and extrapolated: about 6 GB
# (base) and 12 GB (big), besides weights, gradients and Adam state (1.0 GB, 3.4 GB): within a 24 GB
# GPU. A smaller GPU takes --max-tokens N (and the step keeps its size through --accum-steps)
MICRO_BATCH_TOKENS = 12_500


def check_decode(decode: object, where: str) -> dict[str, Any]:
    """``decode`` checked: an object with some of ``beam_size`` (1 to :data:`MAX_SAVED_BEAM`) and
    ``alpha`` (0 to 10). Returns it with :data:`DEFAULT_DECODE` under it.

    Args:
        decode: the settings to check (a dict, or None for none).
        where: what holds them, named in the error (``config.json``, a recipe file).

    Raises:
        ValueError: one line naming ``where``, the key and the value.
    """
    saved = decode or {}
    if not isinstance(saved, dict) or set(saved) - set(DEFAULT_DECODE):
        raise ValueError(f"{where}: decode must be an object with {sorted(DEFAULT_DECODE)}, got {saved!r}"[:300])
    settings = {**DEFAULT_DECODE, **saved}
    beam, penalty = settings["beam_size"], settings["alpha"]
    if not isinstance(beam, int) or isinstance(beam, bool) or not 1 <= beam <= MAX_SAVED_BEAM:
        raise ValueError(f"{where}: decode.beam_size must be an integer from 1 to {MAX_SAVED_BEAM}, got {beam!r}")
    if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not 0 <= penalty <= 10:
        raise ValueError(f"{where}: decode.alpha must be a number from 0 to 10, got {penalty!r}")
    return settings


def decode_settings(config: dict, *, beam_size: int | None = None, alpha: float | None = None) -> dict:
    """Beam size and length penalty for a run: the ones given, else the run's own (its recipe's),
    else :data:`DEFAULT_DECODE`.

    Args:
        config: the run's config.json (its ``decode``, when it has one, is checked).
        beam_size: a beam size that goes over the run's.
        alpha: a length penalty that goes over the run's.

    Returns:
        ``{"beam_size": ..., "alpha": ...}``.
    """
    settings = check_decode(config.get("decode"), "config.json")
    if beam_size is not None:
        settings["beam_size"] = beam_size
    if alpha is not None:
        settings["alpha"] = alpha
    return settings


def step_batches(
    tokens_per_step: int,
    world_size: int,
    *,
    max_tokens: int | None = None,
    accum_steps: int | None = None,
    micro_batch_tokens: int = MICRO_BATCH_TOKENS,
) -> tuple[int, int]:
    """Split a step of ``tokens_per_step`` padded tokens among processes and micro-batches.

    A step trains on ``accum_steps x world_size`` batches of up to ``max_tokens`` padded tokens
    each (:class:`~qkv.training.TrainConfig`). Given neither, ``accum_steps`` is the fewest
    micro-batches that keep a batch within ``micro_batch_tokens`` and ``max_tokens`` shares the
    step evenly: 1 process -> 2 x 12,500; 2 -> 1 x 12,500; 8 -> 1 x 3,125 (the paper's 8 GPUs).
    Given one, the other is chosen to come closest to ``tokens_per_step``; given both, both are kept.

    Returns:
        ``(max_tokens, accum_steps)``.
    """
    for name, value in (
        ("tokens_per_step", tokens_per_step),
        ("world_size", world_size),
        ("max_tokens", max_tokens),
        ("accum_steps", accum_steps),
        ("micro_batch_tokens", micro_batch_tokens),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if max_tokens is not None and accum_steps is not None:
        return max_tokens, accum_steps
    if max_tokens is not None:
        return max_tokens, max(1, round(tokens_per_step / (max_tokens * world_size)))
    if accum_steps is None:
        accum_steps = -(-tokens_per_step // (micro_batch_tokens * world_size))
    return -(-tokens_per_step // (accum_steps * world_size)), accum_steps
