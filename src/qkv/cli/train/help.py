"""``qkv train --help`` and ``--help-all``: the options by group, each with the value a run takes.

Options default to None (the recipe's value), so argparse has no default to show; the help says
what the recipe in view sets instead, e.g. "(default: 2000 from the multi30k recipe)". The recipe
in view is the one the command line names (a pre-pass over ``--recipe``, ``--data``,
``--prepared``, ``--train-text``, ``--train-src``, ``--task``, before or after ``--help``), else the
translation recipe that ``--data multi30k`` and text files train with, and the help says which.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from qkv.cli.train.options import (
    CLI_OPTIONS,
    GROUP_TITLES,
    MODEL_OPTIONS,
    SHORT_HELP_GROUPS,
    declared_help,
    train_fields,
)

DEFAULT_DATA = "multi30k"  # whose recipe --help shows when the command line names no data or recipe
# the data whose recipe shows the defaults of options of the other kind of model than the one in view
KIND_SOURCES = {"translation": "multi30k", "lm": "text"}


@dataclass(frozen=True, kw_only=True)
class RecipeDefaults:
    """What a recipe sets, as the help needs it (read through :func:`recipe_defaults`)."""

    name: str  # as --recipe names it
    task: str  # translation or lm
    model: Mapping[str, Any] = field(default_factory=dict)
    train: Mapping[str, Any] = field(default_factory=dict)
    lm: Mapping[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None
    tokens_per_step: int | None = None  # the step's size, split among processes and batches
    steps: Mapping[str, int] = field(default_factory=dict)  # that split: max_tokens and accum_steps
    bf16_variant: str | None = None  # the recipe suggested where bf16 is fast
    gpu_variant: str | None = None  # the recipe trained in its place on a CUDA device, unless --recipe names one


def recipe_defaults(*, data: str | None = None, recipe: str | None = None) -> RecipeDefaults:
    """The recipe a data source trains with (``data``), or the one named (``recipe``: a name or a
    file): the one place that reads :mod:`qkv.runs.recipes` for the help.

    Raises:
        ValueError, FileNotFoundError: no such recipe, or a file that is not one.
    """
    from qkv.runs.recipes import load_recipe, recipe_for_data

    if (data is None) == (recipe is None):
        raise ValueError(f"give data or recipe, not {'both' if data else 'neither'}")
    found = recipe_for_data(data) if data is not None else load_recipe(str(recipe))
    return RecipeDefaults(
        name=found.name,
        task=found.task,
        model=found.model,
        train=found.train,
        lm=found.lm,
        vocab_size=found.vocab_size,
        tokens_per_step=found.tokens_per_step,
        steps=found.step_options(int(os.environ.get("WORLD_SIZE", "1"))),
        bf16_variant=found.bf16_variant,
        gpu_variant=found.gpu_variant,
    )


@dataclass(frozen=True)
class InView:
    """The recipe the help shows, the option that chose it (None: nothing chose it), and why a
    recipe the command line names could not be shown (None: none failed)."""

    recipe: RecipeDefaults
    chosen_by: str | None
    unreadable: str | None = None


class _PrePass(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def recipe_in_view(given: Sequence[str]) -> InView:
    """The recipe whose values the help shows for the command line ``given`` (its options after
    ``qkv train``): ``--recipe``'s, else the data's, else the default data's (:data:`DEFAULT_DATA`)."""
    pre = _PrePass(add_help=False, allow_abbrev=False)
    for flag in ("--recipe", "--data", "--prepared", "--train-text", "--train-src", "--task"):
        pre.add_argument(flag)
    try:
        known, _ = pre.parse_known_args(list(given))
    except ValueError:  # e.g. --data without a value: the parse proper says so
        known = argparse.Namespace(recipe=None, data=None, prepared=None, train_text=None, train_src=None, task=None)
    candidates = (
        ({"recipe": known.recipe}, f"--recipe {known.recipe}"),
        ({"data": known.data}, f"--data {known.data}"),
        ({"data": "prepared" if known.prepared else None}, "--prepared"),
        ({"data": "text" if known.train_text else None}, "--train-text"),
        ({"data": "files" if known.train_src else None}, "--train-src"),
        ({"data": "text" if known.task == "lm" else None}, "--task lm"),
    )
    unreadable = None
    for wanted, chosen_by in candidates:
        if None in wanted.values():
            continue
        try:
            return InView(recipe_defaults(**wanted), chosen_by, unreadable)
        except (ValueError, FileNotFoundError) as err:  # no such data or recipe: the next one named, if any
            unreadable = unreadable or f"{chosen_by}: {' '.join(str(err).split())}"
    return InView(recipe_defaults(data=DEFAULT_DATA), None, unreadable)


def _shown(value: Any) -> str:
    """A value as the help writes it: on/off, 60 not 60.0, 1e-09."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:g}"
    if isinstance(value, (list, tuple)):
        return " ".join(_shown(v) for v in value)
    return str(value)


def _library_defaults(task: str) -> dict[str, Any]:
    """The model fields' own defaults for a kind of model (a recipe's model leaves them as they are)."""
    from qkv.runs.kinds import kind_named

    config = kind_named(task).model_config()
    return {f.name: getattr(config, f.name) for f in fields(config)}


def _note(value: Any, recipe: RecipeDefaults, key: str, section: Mapping[str, Any]) -> str:
    """ " (default: ...)" for a field of ``section`` (the recipe's model or train fields)."""
    if key not in section:
        return f" (default: {_shown(value)})"
    if key == "bf16" and value:  # precision.bf16_where_fast: a recipe's bf16 is on only where it is fast
        return f" (default: on where bf16 is fast, float32 elsewhere; from the {recipe.name} recipe)"
    return f" (default: {_shown(value)} from the {recipe.name} recipe)"


def _model_notes(view: InView) -> dict[str, str]:
    notes = {}
    other: RecipeDefaults | None = None
    for name, option in MODEL_OPTIONS.items():
        recipe = view.recipe
        model_field = option.lm_field if recipe.task == "lm" else option.translation_field
        if model_field is None:  # an option of the other kind of model: that kind's recipe
            task = "translation" if recipe.task == "lm" else "lm"
            other = other or recipe_defaults(data=KIND_SOURCES[task])
            recipe, model_field = other, option.lm_field if task == "lm" else option.translation_field
        if model_field is None:  # an option of neither kind (none is declared so)
            continue
        value = recipe.model.get(model_field, _library_defaults(recipe.task)[model_field])
        notes[name] = _note(value, recipe, model_field, recipe.model)
    return notes


def _train_notes(view: InView) -> dict[str, str]:
    from qkv.training.config import TrainConfig

    recipe, library = view.recipe, TrainConfig()
    notes = {}
    for f, _ in train_fields():
        notes[f.name] = _note(recipe.train.get(f.name, getattr(library, f.name)), recipe, f.name, recipe.train)
    if recipe.steps:  # computed, not read: say from what, for the processes of this launch
        world = os.environ.get("WORLD_SIZE", "1")
        tokens, accum = recipe.steps["max_tokens"], recipe.steps["accum_steps"]
        split = (
            f"the {recipe.name} recipe's {recipe.tokens_per_step} tokens a step over {world} "
            f"process{'' if world == '1' else 'es'}"
        )
        notes["max_tokens"] = f" (default: {tokens}: {split} and {accum} batch{'' if accum == 1 else 'es'} each)"
        notes["accum_steps"] = f" (default: {accum}: {split} in batches of up to {tokens} tokens)"
    return notes


def default_notes(view: InView) -> dict[str, str]:
    """``{dest: " (default: ...)"}``: the value each option takes when not given, and where from."""
    notes = {option.dest: f" (default: {option.default})" for option in CLI_OPTIONS if option.default}
    recipe = view.recipe
    lm = recipe if recipe.task == "lm" else recipe_defaults(data=KIND_SOURCES["lm"])  # --tokenizer, --windows
    notes.update({key: f" (default: {_shown(value)} from the {lm.name} recipe)" for key, value in lm.lm.items()})
    if recipe.task == "lm":
        notes["vocab_size"] = f" (default: {recipe.vocab_size} from the {recipe.name} recipe)"
    elif view.chosen_by == "--prepared":
        notes["vocab_size"] = " (default: the prepared folder's tokenizer)"
    else:
        notes["vocab_size"] = f" (default: {recipe.vocab_size} from the {recipe.name} recipe)"
    notes.update(_model_notes(view))
    notes.update(_train_notes(view))
    return notes


def says(view: InView) -> str:
    """The line that says whose defaults the help shows."""
    recipe = view.recipe
    variant = f" Where bf16 is fast, the run suggests --recipe {recipe.bf16_variant}." if recipe.bf16_variant else ""
    if recipe.gpu_variant and not (view.chosen_by or "").startswith("--recipe") and _cuda_here():
        variant += (
            f" On this machine's CUDA device, qkv train trains with {recipe.gpu_variant} in its place "
            f"(its defaults: qkv train --recipe {recipe.gpu_variant} --help)."
        )
    if view.unreadable:
        variant += f" (Not shown: {view.unreadable}.)"
    if view.chosen_by is None:
        return (
            f"Defaults shown: the {recipe.name} recipe's (the recipe of --data {DEFAULT_DATA}, of text files "
            "given with --train-src and of --prepared folders); for another's, name it: qkv train --data "
            f"NAME --help (or --recipe NAME, --prepared DIR, --train-text FILE).{variant}"
        )
    return f"Defaults shown: the {recipe.name} recipe's ({view.chosen_by}).{variant}"


def _cuda_here() -> bool:
    """Whether ``qkv train`` would train on a CUDA device here (where the data's recipe gives way to its GPU one)."""
    from qkv.runtime.device import pick_device

    return pick_device().type == "cuda"


def render_help(parser: argparse.ArgumentParser, view: InView, *, every: bool) -> str:
    """The help text: ``parser``'s groups (with ``every``, all of them; else :data:`SHORT_HELP_GROUPS`
    and the ungrouped options), each option with where its default comes from."""
    hidden = set() if every else {GROUP_TITLES[name] for name in GROUP_TITLES if name not in SHORT_HELP_GROUPS}
    base, notes = declared_help(), default_notes(view)
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.add_text(parser.description)
    formatter.add_text(says(view))
    shown = 0
    for group in parser._action_groups:
        if group.title in hidden:
            continue
        actions = []
        for action in group._group_actions:
            if action.dest in base:  # the help as declared, with this recipe's default
                action = copy.copy(action)
                action.help = base[action.dest] + notes.get(action.dest, "")
            actions.append(action)
        shown += len(actions)
        formatter.start_section(group.title)
        formatter.add_text(group.description)
        formatter.add_arguments(actions)
        formatter.end_section()
    if not every:
        left = sum(len(g._group_actions) for g in parser._action_groups if g.title in hidden)
        formatter.add_text(f"qkv train --help-all lists {left} more options: advanced ones and research methods.")
    return formatter.format_help()


class ShortHelp(argparse.Action):
    """``-h``/``--help``: the options most runs need (:data:`SHORT_HELP_GROUPS`), then exit."""

    every = False

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        # the whole command line when the parser kept it (qkv.cli's parser does), else the options before --help
        given = getattr(parser, "given_args", None)
        if given is None:
            given = [
                part
                for dest in ("recipe", "data", "prepared", "train_text", "train_src", "task")
                if getattr(namespace, dest, None)
                for part in ("--" + dest.replace("_", "-"), str(getattr(namespace, dest)))
            ]
        parser._print_message(render_help(parser, recipe_in_view(given), every=self.every), sys.stdout)
        parser.exit()


class FullHelp(ShortHelp):
    """``--help-all``: every option, research methods included, then exit."""

    every = True
