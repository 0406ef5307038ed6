"""How a recipe's tokens per step are split among processes and batches: the part of a recipe that is
computed rather than read (re-exported by :mod:`qkv.runs.recipes`), and the recipe's section that
holds it (:class:`StepsSection`, ``Recipe.steps``). How a run decodes by default is
:mod:`qkv.inference.decode`, re-exported here."""

from __future__ import annotations

from dataclasses import dataclass

from qkv.inference.decode import DEFAULT_DECODE, MAX_BEAM, MAX_SAVED_BEAM, check_decode, decode_settings

__all__ = [
    "DEFAULT_DECODE",
    "MAX_BEAM",
    "MAX_SAVED_BEAM",
    "MICRO_BATCH_TOKENS",
    "StepsSection",
    "check_decode",
    "decode_settings",
    "step_batches",
]

# the largest batch one process takes at once (padded tokens) before it accumulates several. What
# backward keeps of such a batch under bf16 autocast, counted with torch.autograd.graph's
# saved_tensors_hooks for 30-token sentences at 1,200 and 2,400 tokens and extrapolated: about 6 GB
# (base) and 12 GB (big), besides weights, gradients and Adam state (1.0 GB, 3.4 GB): within a 24 GB
# GPU. A smaller GPU takes --max-tokens N (and the step keeps its size through --accum-steps)
MICRO_BATCH_TOKENS = 12_500


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


@dataclass(frozen=True)
class StepsSection:
    """A step's size, ``tokens_per_step`` padded tokens, and how it splits into ``max_tokens`` x
    ``accum_steps`` x processes (:func:`~qkv.runs.recipes.steps.step_batches`)."""

    tokens_per_step: int

    def split(
        self, world_size: int = 1, *, max_tokens: int | None = None, accum_steps: int | None = None
    ) -> dict[str, int]:
        """``max_tokens`` and ``accum_steps`` on ``world_size`` processes (one given is kept, both: both).

        Args:
            world_size: how many processes share a step.
            max_tokens: a batch's padded tokens, if given.
            accum_steps: batches per process per step, if given.

        Returns:
            ``{"max_tokens": ..., "accum_steps": ...}``.
        """
        tokens, accum = step_batches(self.tokens_per_step, world_size, max_tokens=max_tokens, accum_steps=accum_steps)
        return {"max_tokens": tokens, "accum_steps": accum}
