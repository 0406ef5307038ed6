"""A recipe file's tables as typed sections, each checked once when the file is read
(:func:`qkv.runs.recipes.load_recipe`): ``[model]`` (:class:`ModelSection`), ``[train]``
(:class:`TrainSection`), ``[decode]`` (:class:`DecodeSection`) and the step's size
(:class:`~qkv.runs.recipes.steps.StepsSection`, from the top-level ``tokens_per_step``, beside
the split it makes).

A section is a read-only mapping of the keys the file sets (so ``{**recipe.train, ...}``,
``recipe.model["d_model"]`` and ``recipe.decode == {...}`` read as they did in 1.x) that also builds
its config class with the library's defaults under them (:meth:`TrainSection.config`). The files'
keys are the config classes' field names, unchanged since 1.x.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from qkv.inference.decode import DecodeConfig, check_decode
from qkv.runs.recipes.steps import StepsSection

TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a table",
}
TOKENIZER_FIELDS = ("src_vocab_size", "tgt_vocab_size", "pad_id")  # a translation model's, set by its tokenizer


@dataclass(frozen=True, eq=False)
class Section(Mapping[str, Any]):
    """The values one table of a recipe file sets, checked; read as a mapping (equal to a dict of
    the same items)."""

    table: Mapping[str, Any] = field(default_factory=dict)  # the keys the file sets, checked

    def __getitem__(self, key: str) -> Any:
        return self.table[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.table)!r})"


@dataclass(frozen=True, eq=False)
class ModelSection(Section):
    """``[model]``: :class:`~qkv.models.transformer.TransformerConfig` fields (a language model's
    :class:`~qkv.models.causal_lm.CausalLMConfig` fields), the vocabulary left to the tokenizer."""

    task: str = "translation"

    def config_class(self) -> type:
        """The model's config class: TransformerConfig, or CausalLMConfig for a language model."""
        from qkv.models.causal_lm import CausalLMConfig
        from qkv.models.transformer import TransformerConfig

        return CausalLMConfig if self.task == "lm" else TransformerConfig

    @classmethod
    def read(cls, path: Path, table: dict, task: str, vocab_size: int) -> ModelSection:
        """``[model]`` checked key by key, then built once for the config class's own ranges.

        Args:
            path: the recipe file (named in errors).
            table: the parsed table.
            task: the recipe's task (``translation`` or ``lm``).
            vocab_size: the recipe's vocabulary size, which the model is built with here.

        Returns:
            The section.

        Raises:
            ValueError: one line naming the file and the key.
        """
        section = cls(task=task)
        lm = task == "lm"
        config_class = section.config_class()
        values = config_fields(path, "model", table, config_class, ("vocab_size",) if lm else TOKENIZER_FIELDS)
        vocab = {"vocab_size": vocab_size} if lm else {"src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size}
        try:
            config_class(**values, **vocab)
        except ValueError as err:
            raise ValueError(f"{path}: model: {err}") from None
        return cls(values, task=task)


@dataclass(frozen=True, eq=False)
class TrainSection(Section):
    """``[train]``: :class:`~qkv.training.config.TrainConfig` fields."""

    def config(self, **over: Any) -> Any:
        """The :class:`~qkv.training.config.TrainConfig` of these values with ``over`` over them."""
        from qkv.training.config import TrainConfig

        return TrainConfig(**{**self.table, **over})

    @classmethod
    def read(cls, path: Path, table: dict) -> TrainSection:
        """``[train]`` checked key by key and as a whole (TrainConfig's ranges); errors name the file and key."""
        from qkv.training.config import TrainConfig

        section = cls(config_fields(path, "train", table, TrainConfig, ()))
        try:
            section.config()
        except ValueError as err:
            raise ValueError(f"{path}: train: {err}") from None
        return section


@dataclass(frozen=True, eq=False)
class DecodeSection(Section):
    """``[decode]``: a translation recipe's beam size, length penalty and its form, defaults filled in
    (empty for a language model's)."""

    def config(self) -> DecodeConfig:
        """These settings as a :class:`~qkv.inference.decode.DecodeConfig`."""
        return DecodeConfig(**self.table)

    @classmethod
    def read(cls, path: Path, table: dict | None) -> DecodeSection:
        """``[decode]`` checked (:func:`~qkv.inference.decode.check_decode`), the defaults under it."""
        return cls(check_decode(table, str(path)))


def config_fields(path: Path, table: str, values: dict, config_class: type, skip: tuple[str, ...]) -> dict:
    """``values`` checked against ``config_class``'s fields (not those in ``skip``): each key one of
    them, each value of its type; float fields come back as floats and tuple fields as tuples."""
    hints = typing.get_type_hints(config_class)
    known = [f.name for f in fields(config_class) if f.name not in skip]
    checked = {}
    for key, value in values.items():
        if key not in known:
            raise ValueError(
                f"{path}: {table}.{key}: unknown key; {config_class.__name__} fields are {', '.join(known)}"
            )
        checked[key] = check_type(path, f"{table}.{key}", value, hints[key])
    return checked


def check_type(path: Path, key: str, value: Any, kind: Any) -> Any:
    """``value`` if it is of ``kind`` (a float field also takes an integer, returned as a float; a
    tuple field takes a list of numbers, a list field a list of its items' type, an optional field
    ``X | None`` a value of ``X``), else a one-line ``ValueError`` naming the file and key."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        for option in (arg for arg in typing.get_args(kind) if arg is not type(None)):
            try:
                return check_type(path, key, value, option)
            except ValueError:
                continue
        names = " or ".join(_type_name(arg) for arg in typing.get_args(kind) if arg is not type(None))
        raise ValueError(f"{path}: {key}: must be {names}, got {value!r}")
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if isinstance(value, list):
            return [check_type(path, key, v, item) for v in value]
        raise ValueError(f"{path}: {key}: must be a list of {_type_name(item)}, got {value!r}")
    if typing.get_origin(kind) is tuple:
        size = len(typing.get_args(kind))
        if isinstance(value, list) and len(value) == size and all(_is_number(v) for v in value):
            return tuple(float(v) for v in value)
        raise ValueError(f"{path}: {key}: must be a list of {size} numbers, got {value!r}")
    if kind is float and _is_number(value):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ValueError(f"{path}: {key}: must be {_type_name(kind)}, got {value!r}")


def _type_name(kind: Any) -> str:
    return TYPE_NAMES.get(kind, getattr(kind, "__name__", str(kind)))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["DecodeSection", "ModelSection", "Section", "StepsSection", "TrainSection"]
