"""Recipes: the settings a run starts from, one TOML file each beside this module (``multi30k.toml``,
``multi30k-bf16.toml``, ``multi30k-gpu.toml``, ``dates.toml``, ``tinyshakespeare.toml``,
``tinyshakespeare-gpu.toml``, ``paper-base.toml``, ``paper-big.toml``).

A data source trains with the recipe whose ``default_for`` names it (``qkv train --data multi30k``:
``multi30k``) unless another is named (``qkv train --recipe NAME`` or ``--recipe FILE.toml``);
options given explicitly go over the recipe. A named recipe gives the same run on every machine; the
machine decides only the precision (``bf16 = true``: bf16 autocast where it is fast, float32
elsewhere). Where bf16 is fast, a recipe's ``bf16_variant`` is suggested when the run starts, never
switched to. On a CUDA device, a data source's default recipe gives way to its ``gpu_variant``
(``multi30k-gpu``, ``tinyshakespeare-gpu``), and the run says so; a recipe named is never replaced
(:mod:`qkv.runs.recipes.choice`). :func:`load_recipe` reads and checks a file once and returns a
:class:`Recipe`, its tables typed sections (:mod:`qkv.runs.recipes.sections`); how a run merges it
with the options given and the machine is :func:`qkv.runs.resolve.resolve_run_options`; ``qkv recipes`` lists and shows them (docs/recipes.md). Why each value is what it is: docs/history/multi30k-recipe-log.md.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkv.data.tokenizer import MIN_VOCAB_SIZE
from qkv.runs.recipes.budget import BudgetRule, read_budget_rule
from qkv.runs.recipes.sections import (
    DecodeSection,
    ModelSection,
    Section,
    TrainSection,
    check_type,
)
from qkv.runs.recipes.steps import (
    DEFAULT_DECODE,
    MAX_SAVED_BEAM,
    MICRO_BATCH_TOKENS,
    StepsSection,
    check_decode,
    decode_settings,
    step_batches,
)
from qkv.runtime.limits import MAX_VOCAB_SIZE
from qkv.training.config import MAX_ACCUM_STEPS, MAX_BATCH_TOKENS

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (tomli)
    import tomli as tomllib

RECIPE_DIR = Path(__file__).resolve().parent
# a step's tokens: the most batches of the most tokens a step takes (TrainConfig's bounds)
MAX_STEP_TOKENS = MAX_BATCH_TOKENS * MAX_ACCUM_STEPS
TASKS = ("translation", "lm")
# a recipe file's top-level keys and their TOML types; any other key is refused
KEYS: dict[str, type] = {
    "description": str,
    "task": str,
    "default_for": list,
    "bf16_variant": str,
    "gpu_variant": str,
    "vocab_size": int,
    "split_digits": bool,
    "tokens_per_step": int,
    "model": dict,
    "train": dict,
    "decode": dict,
    "lm": dict,
    "budget": dict,
}
REQUIRED = ("description", "task", "vocab_size", "model", "train")
ONLY_FOR = {
    "split_digits": "translation",
    "tokens_per_step": "translation",
    "decode": "translation",
    "lm": "lm",
    "budget": "lm",
}
LM_DEFAULTS = {"tokenizer": "char", "windows": "random"}  # a language-model recipe's [lm], where it says nothing


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One recipe file, read and checked (:func:`load_recipe`), its tables as typed sections
    (:mod:`qkv.runs.recipes.sections`).

    ``model`` (:class:`~qkv.runs.recipes.sections.ModelSection`) holds
    :class:`~qkv.models.transformer.TransformerConfig` fields (a language model's:
    :class:`~qkv.models.causal_lm.CausalLMConfig` fields) and ``train``
    (:class:`~qkv.runs.recipes.sections.TrainSection`) :class:`~qkv.training.config.TrainConfig`
    fields, as the file gives them (float fields as floats, ``adam_betas`` as a tuple); a field the
    file leaves out is the library default. ``decode`` (:class:`~qkv.runs.recipes.sections.DecodeSection`)
    is a translation recipe's beam size and length penalty (:data:`DEFAULT_DECODE` where it says
    nothing), ``steps`` its step's size and split, ``lm`` a language-model recipe's tokenizer and
    training windows. Plain dicts given for the sections are made sections.
    """

    name: str
    description: str
    task: str
    vocab_size: int
    model: ModelSection
    train: TrainSection
    source: Path
    split_digits: bool = False
    tokens_per_step: int | None = None
    decode: DecodeSection = field(default_factory=DecodeSection)
    lm: dict[str, Any] = field(default_factory=dict)
    budget: BudgetRule | None = None  # a language model's size chosen by its budget (qkv.runs.recipes.budget)
    default_for: tuple[str, ...] = ()
    bf16_variant: str | None = None
    gpu_variant: str | None = None

    def __post_init__(self) -> None:
        made: dict[str, Callable[[dict], Section]] = {
            "model": lambda table: ModelSection(table, task=self.task),
            "train": TrainSection,
            "decode": DecodeSection,
        }
        for name, section in made.items():
            value: Mapping[str, Any] = getattr(self, name)
            if not isinstance(value, Section):
                object.__setattr__(self, name, section(dict(value)))

    @property
    def steps(self) -> StepsSection | None:
        """The step's size and how it splits (``tokens_per_step``), or None for a recipe without."""
        return None if self.tokens_per_step is None else StepsSection(self.tokens_per_step)

    @property
    def file(self) -> str:
        """Where the recipe was read from: ``qkv/runs/recipes/NAME.toml`` for one shipped with qkv
        (the same on every machine), else the file's absolute path."""
        if self.source.parent == RECIPE_DIR:
            return f"qkv/runs/recipes/{self.source.name}"
        return str(self.source.resolve())

    def step_options(
        self, world_size: int = 1, *, max_tokens: int | None = None, accum_steps: int | None = None
    ) -> dict[str, int]:
        """``max_tokens`` and ``accum_steps`` for a recipe with ``tokens_per_step`` on ``world_size``
        processes (:func:`step_batches`; one given is kept); ``{}`` for a recipe without."""
        steps = self.steps
        return {} if steps is None else steps.split(world_size, max_tokens=max_tokens, accum_steps=accum_steps)

    def as_dict(self) -> dict[str, Any]:
        """The recipe as plain data (what :data:`RECIPES` holds): its task, vocabulary, model, train
        and, by task, split_digits / decode / tokens_per_step or lm."""
        plain: dict[str, Any] = {"task": self.task, "description": self.description, "vocab_size": self.vocab_size}
        if self.task == "translation":
            plain.update(split_digits=self.split_digits, decode=dict(self.decode))
            if self.tokens_per_step is not None:
                plain["tokens_per_step"] = self.tokens_per_step
        else:
            plain["lm"] = dict(self.lm)
            if self.budget is not None:
                plain["budget"] = self.budget.to_json()
        return {**plain, "model": dict(self.model), "train": dict(self.train)}


def list_recipes() -> list[str]:
    """The names of the recipes shipped with qkv, sorted."""
    return sorted(path.stem for path in RECIPE_DIR.glob("*.toml"))


def translation_recipes() -> list[str]:
    """The names of the shipped recipes of a translation model."""
    return [name for name in list_recipes() if load_recipe(name).task == "translation"]


@functools.cache
def _defaults() -> dict[str, str]:
    """Data source -> the shipped recipe whose ``default_for`` names it (also an alias: ``files``)."""
    found: dict[str, str] = {}
    for name in list_recipes():
        for source in tomllib.loads((RECIPE_DIR / f"{name}.toml").read_text(encoding="utf-8")).get("default_for", []):
            found[source] = name
    return found


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Read and check a recipe: a shipped one by name (``multi30k``; the data sources ``files`` and
    ``text`` name their default recipes), or a file (a ``.toml`` name or any path).

    Raises:
        ValueError: an unknown name, or a file that is not a recipe: one line naming the file and the
            key (unknown keys, wrong types, values out of range).
        FileNotFoundError: a file that does not exist.
    """
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or text.endswith(".toml") or "/" in text or "\\" in text:
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{text}: no such recipe file")
    else:
        path = RECIPE_DIR / f"{_defaults().get(text, text)}.toml"
        if not path.is_file():
            raise ValueError(
                f"unknown recipe {text!r}; choose one of {', '.join(list_recipes())} (qkv recipes lists them) "
                "or give a .toml file"
            )
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a TOML file ({err})") from None
    except RecursionError:  # tomllib parses nested tables and arrays recursively
        raise ValueError(f"{path}: not a recipe: its tables or arrays are nested too deep to read") from None
    return _recipe_from(raw, path)


def recipe_for_data(source: str) -> Recipe:
    """The recipe a data source trains with when none is named (a prepared folder: the files' one)."""
    from qkv.data.sources import recipe_source

    name = _defaults().get(recipe_source(source))
    if name is None:
        raise ValueError(f"no recipe is declared for data source {source!r}")
    return load_recipe(name)


def _recipe_from(raw: dict[str, Any], path: Path) -> Recipe:
    """A :class:`Recipe` from a parsed file, every key and value checked."""
    for key, value in raw.items():
        if key not in KEYS:
            raise ValueError(f"{path}: {key}: unknown key; a recipe's keys are {', '.join(KEYS)}")
        check_type(path, key, value, KEYS[key])
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise ValueError(f"{path}: {missing[0]}: missing (every recipe has {', '.join(REQUIRED)})")
    task = raw["task"]
    if task not in TASKS:
        raise ValueError(f"{path}: task: must be one of {', '.join(TASKS)}, got {task!r}")
    for key, only in ONLY_FOR.items():
        if key in raw and only != task:
            raise ValueError(f"{path}: {key}: a key of {only} recipes only (this one's task is {task})")
    vocab_size, per_step = raw["vocab_size"], raw.get("tokens_per_step")
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"{path}: vocab_size: must be >= {MIN_VOCAB_SIZE} (256 bytes + 4 specials) and <= {MAX_VOCAB_SIZE:,}, "
            f"got {vocab_size!r}"
        )
    if per_step is not None and not 1 <= per_step <= MAX_STEP_TOKENS:
        raise ValueError(f"{path}: tokens_per_step: must be >= 1 and <= {MAX_STEP_TOKENS:,}, got {per_step!r}")
    if "\n" in raw["description"]:
        raise ValueError(f"{path}: description: must be one line")
    model = ModelSection.read(path, raw["model"], task, vocab_size)
    train = TrainSection.read(path, raw["train"])
    return Recipe(
        name=path.stem,
        description=raw["description"],
        task=task,
        vocab_size=vocab_size,
        model=model,
        train=train,
        source=path,
        split_digits=raw.get("split_digits", False),
        tokens_per_step=per_step,
        decode=DecodeSection.read(path, raw.get("decode")) if task == "translation" else DecodeSection(),
        lm=_lm_settings(path, raw.get("lm", {})) if task == "lm" else {},
        budget=read_budget_rule(path, raw["budget"], model) if "budget" in raw else None,
        default_for=_default_for(path, raw.get("default_for", []), task),
        bf16_variant=raw.get("bf16_variant"),
        gpu_variant=raw.get("gpu_variant"),
    )


def _lm_settings(path: Path, values: dict[str, Any]) -> dict[str, Any]:
    from qkv.data.text import TOKENIZER_KINDS
    from qkv.training.language_model_task import LanguageModelTask

    choices = {"tokenizer": TOKENIZER_KINDS, "windows": LanguageModelTask.WINDOWS}
    for key, value in values.items():
        if key not in choices:
            raise ValueError(f"{path}: lm.{key}: unknown key; a language model's settings are {', '.join(choices)}")
        if value not in choices[key]:
            raise ValueError(f"{path}: lm.{key}: must be one of {', '.join(choices[key])}, got {value!r}")
    return {**LM_DEFAULTS, **values}


def _default_for(path: Path, sources: list, task: str) -> tuple[str, ...]:
    from qkv.data.sources import SOURCES
    from qkv.data.text import TEXT_SOURCES

    fitting = TEXT_SOURCES if task == "lm" else tuple(s for s in SOURCES if s != "prepared")
    for source in sources:
        if source not in fitting:
            raise ValueError(
                f"{path}: default_for: {source!r} is not a data source a {task} recipe can be the default of "
                f"({', '.join(fitting)})"
            )
    return tuple(sources)


@functools.cache
def _plain_recipes() -> dict[str, dict[str, Any]]:
    recipes = {name: load_recipe(name).as_dict() for name in list_recipes()}
    return {**recipes, **{source: recipes[name] for source, name in _defaults().items()}}


def __getattr__(name: str) -> Any:
    """``RECIPES``: every shipped recipe as plain data (:meth:`Recipe.as_dict`), by name and by the data
    sources it is the default of (``files``, ``text``), read on first use (for scripts)."""
    if name == "RECIPES":
        return _plain_recipes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_DECODE",
    "MAX_SAVED_BEAM",
    "MICRO_BATCH_TOKENS",
    "DecodeSection",
    "ModelSection",
    "Recipe",
    "StepsSection",
    "TrainSection",
    "check_decode",
    "decode_settings",
    "list_recipes",
    "load_recipe",
    "recipe_for_data",
    "step_batches",
    "translation_recipes",
]
