"""A language model sized by its budget: a recipe's ``[budget]`` table lists model sizes, smallest
first, and the tokens each parameter should see; a run takes the largest size whose parameters the
budget's tokens cover that many times.

The tokens a budget affords are ``--max-steps x tokens a step``, or ``--epochs x the training
tokens``, or, for ``--minutes M``, ``M x 60 x`` the training speed of that size measured on this
machine (a few real training steps of each size, timed once per machine and kept in qkv's cache,
which each run checks by timing the smallest size again: :func:`measured_speeds`); where several are
set, the smallest. A recipe file says, for instance::

    [budget]
    tokens_per_parameter = 4.0

    [budget.sizes]  # smallest first
    small = {d_model = 128, num_layers = 4, num_heads = 4, d_ff = 512, context = 64, max_tokens = 2048}
    large = {d_model = 256, num_layers = 4, num_heads = 4, d_ff = 1024, context = 128, max_tokens = 4096}

Each size is a set of :class:`~qkv.models.causal_lm.CausalLMConfig` fields, plus the tokens a
training step takes (``max_tokens``); what a size leaves out is the recipe's ``[model]``. The rule
and the runs it was chosen from: docs/language-models.md, "The budget decides the size".
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from qkv.runtime.meta import meta_device
from qkv.training.config import MAX_BATCH_TOKENS

logger = logging.getLogger(__name__)

SIZE_KEYS_TRAIN = ("max_tokens",)  # a size's keys that are TrainConfig fields, not the model's
# a size's keys that say how it trains, not how large it is: an option given sets them for every size
# and the budget still chooses (a size option given, such as --d-model, turns the rule off)
SIZE_KEYS_SETTINGS = ("dropout",)
CACHE_NAME = "lm_speeds.json"
TIMED_STEPS, WARMUP_STEPS, MAX_TIMED_SECONDS = 6, 2, 3.0
DRIFT = 0.2  # a cache is trusted while the smallest size, timed again, is within 20% of its cached speed


@dataclass(frozen=True)
class BudgetRule:
    """A recipe's ``[budget]``: ``sizes`` (model and ``max_tokens`` values, smallest first, by name in
    ``names``) and the tokens per parameter the chosen size must be trained on at least."""

    tokens_per_parameter: float
    sizes: tuple[dict[str, Any], ...]
    names: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The rule as plain data, shaped as the recipe file's ``[budget]`` table.

        Returns:
            ``{"tokens_per_parameter": ..., "sizes": {name: size}}``, the sizes in order, smallest
            first.
        """
        sizes = {name: dict(size) for name, size in zip(self.names, self.sizes, strict=True)}
        return {"tokens_per_parameter": self.tokens_per_parameter, "sizes": sizes}


def read_budget_rule(path: Path, values: dict[str, Any], model: Mapping[str, Any]) -> BudgetRule:
    """A ``[budget]`` table checked: each size's keys are model fields or ``max_tokens``, each size
    builds a model over the recipe's ``model`` values, and sizes grow in parameters.

    Raises:
        ValueError: one line naming the file and key.
    """
    from qkv.models.causal_lm import CausalLMConfig

    unknown = sorted(set(values) - {"tokens_per_parameter", "sizes"})
    if unknown:
        raise ValueError(f"{path}: budget.{unknown[0]}: unknown key; [budget] has tokens_per_parameter and sizes")
    ratio, sizes = values.get("tokens_per_parameter"), values.get("sizes")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < math.inf:
        raise ValueError(f"{path}: budget.tokens_per_parameter: must be a number > 0 and finite, got {ratio!r}")
    if not isinstance(sizes, dict) or not sizes or not all(isinstance(s, dict) for s in sizes.values()):
        raise ValueError(f"{path}: budget.sizes: must be a table of named sizes (each a table), got {sizes!r}")
    known = {f.name for f in fields(CausalLMConfig)} - {"vocab_size"}
    counts = []
    for i, size in sizes.items():
        bad = sorted(set(size) - known - set(SIZE_KEYS_TRAIN))
        if bad:
            raise ValueError(f"{path}: budget.sizes[{i}].{bad[0]}: not a language model's field or max_tokens")
        tokens = size.get("max_tokens", 1)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_BATCH_TOKENS:
            raise ValueError(
                f"{path}: budget.sizes[{i}].max_tokens: must be an integer >= 1 and <= {MAX_BATCH_TOKENS:,}, "
                f"got {tokens!r}"
            )
        try:
            config = CausalLMConfig(**{**model, **model_values(size), "vocab_size": 256})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: budget.sizes[{i}]: {err}") from None
        counts.append(parameters(config))
    if counts != sorted(counts):
        raise ValueError(f"{path}: budget.sizes: list the sizes smallest first (parameters {counts})")
    return BudgetRule(float(ratio), tuple(dict(s) for s in sizes.values()), tuple(sizes))


def with_settings(rule: BudgetRule, options: Mapping[str, Any]) -> BudgetRule:
    """The rule with the settings among ``options`` (:data:`SIZE_KEYS_SETTINGS`) over each size's own."""
    given = {k: v for k, v in options.items() if k in SIZE_KEYS_SETTINGS}
    return replace(rule, sizes=tuple({**size, **given} for size in rule.sizes)) if given else rule


def model_values(size: dict[str, Any]) -> dict[str, Any]:
    """A size's model fields (without ``max_tokens``)."""
    return {k: v for k, v in size.items() if k not in SIZE_KEYS_TRAIN}


def parameters(config: Any) -> int:
    """The parameters of a :class:`~qkv.models.causal_lm.CausalLM` of ``config``, built on the meta device."""
    from qkv.models.causal_lm import CausalLM

    with meta_device():
        return sum(p.numel() for p in CausalLM(config).parameters())


@dataclass(frozen=True)
class SizeChoice:
    """The size a budget chose: its index in the rule's sizes, the tokens the budget affords it,
    its parameters, and one line saying why."""

    index: int
    tokens: float
    parameters: int
    why: str


def choose_size(
    rule: BudgetRule,
    model: Mapping[str, Any],
    vocab_size: int,
    *,
    minutes: float,
    max_steps: int,
    epochs: float,
    train_tokens: int,
    speed: Callable[[int], float],
) -> SizeChoice:
    """The largest of ``rule``'s sizes whose parameters the budget's tokens cover
    ``rule.tokens_per_parameter`` times (else the smallest). ``speed(i)`` gives size ``i``'s measured
    training tokens per second, and is asked only with ``minutes`` set."""
    from qkv.models.causal_lm import CausalLMConfig

    chosen = None
    for i in reversed(range(len(rule.sizes))):
        size = rule.sizes[i]
        config = CausalLMConfig(**{**model, **model_values(size), "vocab_size": vocab_size})
        count = parameters(config)
        step_tokens = size.get("max_tokens", 0) // config.context * config.context
        affordable = [
            x
            for x in (
                max_steps * step_tokens if max_steps else None,
                epochs * train_tokens if epochs else None,
                minutes * 60 * speed(i) if minutes else None,
            )
            if x
        ]
        tokens = min(affordable) if affordable else 0.0
        chosen = SizeChoice(i, tokens, count, "")
        if tokens >= rule.tokens_per_parameter * count:
            break
    assert chosen is not None  # a rule has at least one size
    size = rule.sizes[chosen.index]
    described = ", ".join(f"{k} {v}" for k, v in size.items())
    why = (
        f"the budget affords {chosen.tokens / 1e6:.2f}M training tokens to size {rule.names[chosen.index]} ({described}; "
        f"{chosen.parameters / 1e6:.2f}M parameters, {chosen.tokens / chosen.parameters:.1f} tokens each): "
        + (
            f"the largest of {len(rule.sizes)} sizes with >= {rule.tokens_per_parameter:g} tokens per parameter"
            if chosen.tokens >= rule.tokens_per_parameter * chosen.parameters
            else f"the smallest of {len(rule.sizes)} sizes (none gets {rule.tokens_per_parameter:g} tokens per parameter)"
        )
    )
    return SizeChoice(chosen.index, chosen.tokens, chosen.parameters, why)


def measured_speeds(
    rule: BudgetRule,
    model: Mapping[str, Any],
    task_for: Callable[[int], Any],
    *,
    vocab_size: int,
    device: torch.device,
    bf16: bool,
    cache_dir: Path | None,
    weight_decay: float = 0.0,
    optimizer: str = "adamw",
) -> Callable[[int], float]:
    """``speed(i)``: size ``i``'s training tokens per second on this machine, measured on first
    use (``WARMUP_STEPS`` untimed and ``TIMED_STEPS`` timed real steps of a fresh model on
    ``task_for(context)``'s batches, with the run's optimizer: ``optimizer``, AdamW's part of it
    with ``weight_decay``; Muon's Newton-Schulz iterations make its steps slower)
    and kept in ``cache_dir/lm_speeds.json`` under a key of the machine, threads, torch, device,
    precision, optimizer and size. The cache holds numbers only: anything
    else in it is ignored and measured again.

    A machine of one kind can run at another speed on another day (a cloud machine's neighbours: the
    same 2-core EPYC trained at half its morning's speed one afternoon), so the smallest size is timed
    again once per call (a second or two) and the cache is trusted only where that is within
    ``DRIFT`` of the speed it holds for it; otherwise every size asked for is measured again and kept."""
    found: dict[int, float] = {}
    trusted: list[bool] = []  # decided once, on the first speed asked for

    def key_of(i: int) -> str:
        return _speed_key(rule.sizes[i], model, vocab_size, device, bf16, weight_decay, optimizer)

    def measure(i: int) -> float:
        measured = _measure(
            rule.sizes[i],
            model,
            task_for,
            vocab_size=vocab_size,
            device=device,
            bf16=bf16,
            weight_decay=weight_decay,
            optimizer=optimizer,
        )
        _write_cache(cache_dir, key_of(i), measured)
        return measured

    def speed(i: int) -> float:
        if not trusted:  # first: time the smallest size, and hold the cache against it
            then = _read_cache(cache_dir).get(key_of(0))
            found[0] = now = measure(0)
            trusted.append(then is not None and abs(now / then - 1) <= DRIFT)
            if then is not None and not trusted[0]:
                logger.info(
                    "this machine trains at %.0f%% of the speed in qkv's cache (%s): the sizes are measured again",
                    100 * now / then,
                    cache_dir,
                )
        if i not in found:
            cached = _read_cache(cache_dir).get(key_of(i)) if trusted[0] else None
            found[i] = cached if cached is not None else measure(i)
        return found[i]

    return speed


def _speed_key(
    size: dict,
    model: Mapping,
    vocab_size: int,
    device: torch.device,
    bf16: bool,
    weight_decay: float,
    optimizer: str = "adamw",
) -> str:
    from qkv.runtime.machine import cpuinfo_fields

    cpu = cpuinfo_fields("model name", "cpu family", "model", "flags")
    what = {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "bf16": bf16,
        "model": {**model, **size, "vocab_size": vocab_size},
    }
    if weight_decay or optimizer != "adamw":  # the keys of plain Adam runs unchanged
        chosen: dict[str, object] = {"weight_decay": weight_decay}  # AdamW's two groups: slower than Adam
        if optimizer != "adamw":
            chosen["name"] = optimizer
        what["optimizer"] = chosen
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read_cache(cache_dir: Path | None) -> dict[str, float]:
    if cache_dir is None:
        return {}
    try:
        data = json.loads((cache_dir / CACHE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        k: float(v)
        for k, v in data.items()
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e12
    }


def _write_cache(cache_dir: Path | None, key: str, value: float) -> None:
    if cache_dir is None:
        return
    from qkv.runtime.fileio import write_json

    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_json(cache_dir / CACHE_NAME, {**_read_cache(cache_dir), key: round(value, 1)})
    except OSError as err:  # a read-only cache: measure again next time
        logger.warning("could not keep the measured speed in %s: %s", cache_dir, err)


def _measure(
    size: dict,
    model: Mapping,
    task_for: Callable[[int], Any],
    *,
    vocab_size: int,
    device: torch.device,
    bf16: bool,
    weight_decay: float = 0.0,
    optimizer: str = "adamw",
) -> float:
    """Training tokens per second of a fresh model of ``size``: real steps (forward, backward, the
    optimizer: ``optimizer``, Adam or AdamW with ``weight_decay``)."""
    from qkv.models.causal_lm import CausalLM, CausalLMConfig
    from qkv.training import TrainConfig, Trainer

    config = CausalLMConfig(**{**model, **model_values(size), "vocab_size": vocab_size})
    task = task_for(config.context)
    train = TrainConfig(
        max_tokens=size.get("max_tokens", 4096),
        max_steps=1,
        bf16=bf16,
        progress=False,
        weight_decay=weight_decay,
        optimizer=optimizer,
    )
    # measuring leaves the random state (the run's seeded weights, its dropout) as it found it
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        trainer = Trainer(CausalLM(config).to(device), task, train, None)
        batches = task.batches(0, train.max_tokens, 0)
        tokens, start = 0, 0.0
        for n, indices in enumerate(batches[: WARMUP_STEPS + TIMED_STEPS]):
            if n == WARMUP_STEPS:
                _sync(device)
                tokens, start = 0, time.perf_counter()
            elif n > WARMUP_STEPS + 1 and time.perf_counter() - start > MAX_TIMED_SECONDS:
                break  # a slow size: two timed steps or more, within a few seconds
            tokens += trainer.step([task.make_batch(indices)]).tokens
        _sync(device)
        return tokens / max(time.perf_counter() - start, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
