"""The one place a run's training options are put together: the recipe's ``[train]`` table, its
``tokens_per_step`` split over the machine's processes, and the options given (the command line or
a caller of :func:`~qkv.runs.lifecycle.start_run`) over both. :func:`resolve_run_options` does it
once and returns a :class:`ResolvedOptions`, which ``qkv train`` (through the lifecycle), the run
kinds' start hooks and ``qkv recipes show`` read; its :meth:`ResolvedOptions.lines` are the run's
first lines: each option set, grouped by where it came from.

Where bf16 autocast is slow, a recipe's ``bf16 = true`` is turned off (one the user gave is kept):
that rule is :func:`qkv.runtime.precision.bf16_where_fast`, applied here when the machine's speed
is known (``bf16_fast``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qkv.training.config import TrainConfig

if TYPE_CHECKING:
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
    """

    recipe_name: str
    train: dict[str, Any]
    origins: dict[str, str]
    given: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    tokens_per_step: int | None = None

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
        bf16_fast: whether bf16 products are fast where the run trains (None: not known yet): a
            recipe's bf16 is turned off where they are slow, one given is kept.

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
    if bf16_fast is False and train.get("bf16") and origins["bf16"] == RECIPE:
        train["bf16"], origins["bf16"] = False, MACHINE
    return ResolvedOptions(
        recipe_name=recipe.name,
        train=train,
        origins=origins,
        given=given,
        world_size=world_size,
        tokens_per_step=recipe.tokens_per_step,
    )


def as_resolved(recipe: Recipe, options: dict[str, Any] | ResolvedOptions | None) -> ResolvedOptions:
    """``options`` as a run kind's start hook receives them: resolved already (from
    :func:`~qkv.runs.lifecycle.start_run`), or the options given over ``recipe``, resolved here
    for one process (a hook called directly).

    Args:
        recipe: the run's recipe.
        options: a :class:`ResolvedOptions`, or TrainConfig fields given (None: none).

    Returns:
        The :class:`ResolvedOptions`.
    """
    if isinstance(options, ResolvedOptions):
        return options
    return resolve_run_options(recipe, options)


__all__ = ["ORIGINS", "ResolvedOptions", "as_resolved", "resolve_run_options"]
