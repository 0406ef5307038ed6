"""Which recipe a run starts from, and what it says about it: the recipe named (``qkv train --recipe``),
else the data's default. The one thing the machine changes: on a CUDA device the data's default
gives way to its ``gpu_variant`` (``multi30k`` -> ``multi30k-gpu``, ``tinyshakespeare`` ->
``tinyshakespeare-gpu``), and the start line and config.json's ``"recipe"`` say so; a recipe named
is never replaced, and on a CPU nothing changes. Where bf16 is fast, a recipe's ``bf16_variant`` is
suggested in one line when the run starts, and nothing changes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.runs.recipes import Recipe, load_recipe, recipe_for_data

if TYPE_CHECKING:
    import torch

TASK_WORDS = {"lm": "language-model", "translation": "translation"}


@dataclass(frozen=True, kw_only=True)
class RecipeChoice:
    """The recipe a run trains with, why (in words, recorded in config.json), and whether it was named."""

    recipe: Recipe
    why: str
    named: bool

    def record(self) -> dict[str, str]:
        """config.json's ``"recipe"``: ``{"name", "file", "why"}``."""
        return {"name": self.recipe.name, "file": self.recipe.file, "why": self.why}

    def start_notes(self, *, bf16: bool, bf16_fast: bool) -> list[str]:
        """The lines a run prints when it starts: which recipe, from which file and why, and whether it
        trains in bf16; where bf16 is fast and the recipe came with the data, its ``bf16_variant``,
        suggested with what it changes.

        Args:
            bf16: whether the run trains under bf16 autocast (the recipe's bf16 where it is fast).
            bf16_fast: whether bf16 matrix products are fast on the run's device.

        Returns:
            One or two lines.
        """
        recipe = self.recipe
        lines = [f"recipe {recipe.name} ({recipe.file}): {self.why}; bf16 autocast {'on' if bf16 else 'off'}"]
        if bf16 and bf16_fast and not self.named and recipe.bf16_variant:
            variant = load_recipe(recipe.bf16_variant)
            changes = ", ".join(f"{key} {value}" for key, value in differences(recipe, variant).items())
            lines.append(
                f"bf16 is fast here: --recipe {variant.name} is {recipe.name} tuned for it ({changes}); this "
                f"run keeps {recipe.name}, as on every machine"
            )
        return lines


def choose_recipe(
    named: str | Path | Recipe | None, source: str, device: str | torch.device | None = None
) -> RecipeChoice:
    """The recipe a run on data ``source`` trains with: ``named`` (a name, a file or a
    :class:`~qkv.runs.recipes.Recipe`), else the data's default (:func:`~qkv.runs.recipes.recipe_for_data`),
    or, where ``device`` is a CUDA device, that default's ``gpu_variant`` (:func:`on_cuda`).

    Args:
        named: the recipe asked for (``qkv train --recipe``), or None for the data's.
        source: the data source (``multi30k``, ``files``, ``tinyshakespeare``, ...).
        device: where the run trains (None: as on a CPU, the data's default as it is).

    Raises:
        ValueError: a recipe of another task than the data's (a translation recipe for a text), an
            unknown name or a bad file.
        FileNotFoundError: a recipe file that does not exist.
    """
    from qkv.data.text import TEXT_SOURCES

    if named is None:
        recipe, why = recipe_for_data(source), f"the default recipe for {source} data"
        if recipe.gpu_variant and on_cuda(device):
            cpu_recipe, recipe = recipe, load_recipe(recipe.gpu_variant)
            why += (
                f" on a CUDA device ({device}): {recipe.name}, in place of the CPU recipe {cpu_recipe.name} "
                f"(--recipe {cpu_recipe.name} keeps that one)"
            )
    else:
        recipe = named if isinstance(named, Recipe) else load_recipe(named)
        why = f"named (--recipe {recipe.name if isinstance(named, Recipe) else named})"
    task = "lm" if source in TEXT_SOURCES else "translation"
    if recipe.task != task:
        raise ValueError(
            f"--recipe {recipe.name} is a {TASK_WORDS[recipe.task]} recipe, and {source} data trains a "
            f"{TASK_WORDS[task]} model: name a {TASK_WORDS[task]} recipe (qkv recipes lists them) or leave --recipe out"
        )
    return RecipeChoice(recipe=recipe, why=why, named=named is not None)


def on_cuda(device: str | torch.device | None) -> bool:
    """Whether ``device`` (a torch device or its name, e.g. ``cuda:0``) is a CUDA device: where a data
    source's default recipe gives way to its ``gpu_variant``. None (not known) counts as not."""
    return device is not None and str(device).split(":")[0] == "cuda"


def differences(recipe: Recipe, other: Recipe) -> dict[str, Any]:
    """The model, training and decoding values ``other`` sets that ``recipe`` sets otherwise or not at all."""
    changed = {}
    for table in ("model", "train", "decode"):
        mine, theirs = getattr(recipe, table), getattr(other, table)
        changed.update({key: value for key, value in theirs.items() if mine.get(key) != value})
    return changed
