"""The one place a run's training options are put together: the recipe's ``[train]`` table, its
``tokens_per_step`` split over the machine's processes, and the options given (the command line or
a caller of :func:`~qkv.runs.lifecycle.start_run`) over both. :func:`resolve_run_options` does it
once and returns a :class:`ResolvedOptions`, which ``qkv train`` (through the lifecycle), the run
kinds' start hooks and ``qkv recipes show`` read; its :meth:`ResolvedOptions.lines` are the run's
first lines: each option set, grouped by where it came from.

Where bf16 autocast is slow, a recipe's ``bf16 = true`` is turned off (one the user gave is kept,
with a warning): the rule of :func:`qkv.runtime.precision.bf16_where_fast`, applied here and only
here, once the machine is known (``device`` or ``bf16_fast``). The run kinds read the result
(``train_config().bf16``, and where it came from, ``origin("bf16")``) and decide nothing about
precision themselves; what the rule did is said with the run's first lines (:meth:`ResolvedOptions.say`),
once the inputs are known to be usable, not when it is decided.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qkv.runtime import precision
from qkv.training.config import TrainConfig

if TYPE_CHECKING:
    import torch

    from qkv.runs.recipes import Recipe

RECIPE, GIVEN, MACHINE, DEFAULT = "recipe", "command line", "machine", "default"
ORIGINS = (RECIPE, GIVEN, MACHINE, DEFAULT)


@dataclass(frozen=True, kw_only=True)
class ResolvedOptions:
    """A run's training options, resolved once (:func:`resolve_run_options`).

    ``train`` holds the :class:`~qkv.training.config.TrainConfig` fields set by the recipe, by the
    split of its step, by the machine or by the options given (a field not there is the default);
    ``origins`` says where each came from (one of :data:`ORIGINS`); ``given`` is the options given
    alone (what a run kind treats as asked for: an explicit ``bf16``, a size that turns a budget off).
    ``bf16_fast`` is whether bf16 products are fast where the run trains (None: not known), and
    ``device_type`` that device's type (``"cpu"``, ``"cuda"``; None: not known).
    """

    recipe_name: str
    train: dict[str, Any]
    origins: dict[str, str]
    given: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    tokens_per_step: int | None = None
    bf16_fast: bool | None = None
    device_type: str | None = None

    def train_config(self) -> TrainConfig:
        """The :class:`~qkv.training.config.TrainConfig` of these options (checked)."""
        return TrainConfig.from_dict(self.train)

    def origin(self, name: str) -> str:
        """Where the field ``name`` came from: recipe, command line, machine or default."""
        return self.origins.get(name, DEFAULT)

    def lines(self) -> list[str]:
        """What a run prints first: one line per origin that set something (recipe, command line,
        machine), each ``key value`` as resolved; the other fields are TrainConfig's defaults.

        Returns:
            One to three lines.
        """
        lines = []
        for origin in (RECIPE, GIVEN, MACHINE):
            keys = [key for key in self.train if self.origins.get(key) == origin]
            if origin == MACHINE:
                words = [f"{self.world_size} process{'' if self.world_size == 1 else 'es'}"]
            else:
                words = []
            words += [f"{key} {_word(self.train[key])}" for key in keys]
            if origin == RECIPE and self.tokens_per_step is not None:
                accum, tokens = self.train.get("accum_steps", 1), self.train.get("max_tokens")
                words.append(
                    f"(a step: {self.world_size} x {accum} x {tokens} = {self.world_size * accum * tokens} "
                    f"of the recipe's {self.tokens_per_step} tokens)"
                )
            if words:
                where = f"recipe {self.recipe_name}" if origin == RECIPE else origin
                lines.append(f"options from the {where}: {', '.join(words)}")
        return lines

    def warnings(self) -> list[str]:
        """What the options ask for that the machine does badly: bf16 given where it is slow.

        Returns:
            Zero or one line.
        """
        if self.train.get("bf16") and self.origin("bf16") == GIVEN and self.bf16_fast is False:
            where = self.device_type or "device"
            return [
                f"bf16 autocast asked for, but bfloat16 matrix products are slower than float32 on this {where} "
                "(no bf16 matrix instructions): expect slow steps"
            ]
        return []

    def say(self, logger: logging.Logger) -> None:
        """Log :meth:`lines` (info) and :meth:`warnings` (warning): a run kind calls this once its
        inputs are known to be usable, so a refused input's error is all the user reads.

        Args:
            logger: the run kind's logger.
        """
        for line in self.lines():
            logger.info(line)
        for line in self.warnings():
            logger.warning(line)


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def resolve_run_options(
    recipe: Recipe,
    given: dict[str, Any] | None = None,
    *,
    world_size: int = 1,
    device: str | torch.device | None = None,
    bf16_fast: bool | None = None,
) -> ResolvedOptions:
    """Merge a recipe's training options, its step's split over ``world_size`` processes and the
    options ``given``, once.

    Args:
        recipe: the run's recipe (:class:`~qkv.runs.recipes.Recipe`).
        given: :class:`~qkv.training.config.TrainConfig` fields given explicitly (``qkv train``'s
            flags); they win over the recipe. A ``max_tokens`` or ``accum_steps`` given is kept and
            the other chosen to fill the recipe's ``tokens_per_step``.
        world_size: how many processes train together (the machine's part of the split).
        device: where the run trains; whether bf16 is fast there is asked of
            :func:`qkv.runtime.precision.bf16_is_fast` (unless ``bf16_fast`` says it).
        bf16_fast: whether bf16 products are fast where the run trains (None: ask ``device``, or
            not known where it is None too): a recipe's bf16 is turned off where they are slow
            (:func:`qkv.runtime.precision.bf16_where_fast`'s rule), one given is kept.

    Returns:
        The :class:`ResolvedOptions`.

    Raises:
        ValueError: a ``max_tokens`` or ``accum_steps`` that is not an integer >= 1 (the other
            fields are checked by :meth:`ResolvedOptions.train_config`).
    """
    given = dict(given or {})
    train: dict[str, Any] = dict(recipe.train)
    origins = dict.fromkeys(train, RECIPE)
    steps = recipe.steps
    split = {} if steps is None else steps.split(world_size, **{k: given.get(k) for k in ("max_tokens", "accum_steps")})
    for key, value in split.items():
        train[key], origins[key] = value, RECIPE
    for key, value in given.items():
        train[key], origins[key] = value, GIVEN
    if bf16_fast is None and device is not None:
        bf16_fast = precision.bf16_is_fast(device)
    if bf16_fast is False and train.get("bf16") and origins["bf16"] == RECIPE:
        # bf16_where_fast's rule, said with the run's first lines rather than logged now (as that
        # function does), before the inputs are checked
        train["bf16"], origins["bf16"] = False, MACHINE
    return ResolvedOptions(
        recipe_name=recipe.name,
        train=train,
        origins=origins,
        given=given,
        world_size=world_size,
        tokens_per_step=recipe.tokens_per_step,
        bf16_fast=bf16_fast,
        device_type=None if device is None else _device_type(device),
    )


def _device_type(device: str | torch.device) -> str:
    return str(device).split(":")[0]


def as_resolved(
    recipe: Recipe, options: dict[str, Any] | ResolvedOptions | None, *, device: str | torch.device | None = None
) -> ResolvedOptions:
    """``options`` as a run kind's start hook receives them: resolved already (from
    :func:`~qkv.runs.lifecycle.start_run`, for the device the run trains on), or the options given
    over ``recipe``, resolved here for one process on ``device`` (a hook called directly).

    Args:
        recipe: the run's recipe.
        options: a :class:`ResolvedOptions`, or TrainConfig fields given (None: none).
        device: where a hook called directly trains (None: the machine not known, bf16 as asked).

    Returns:
        The :class:`ResolvedOptions`.
    """
    if isinstance(options, ResolvedOptions):
        return options
    return resolve_run_options(recipe, options, device=device)


__all__ = ["ORIGINS", "ResolvedOptions", "as_resolved", "resolve_run_options"]
