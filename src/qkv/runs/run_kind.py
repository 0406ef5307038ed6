""":class:`RunKind`: one kind of run (translation, language model) stated once.

A kind names what differs between runs of different models; everything else (checking options,
creating the folder whole or not at all, resuming, finishing) is the one lifecycle in
:mod:`qkv.runs.lifecycle`. The kinds qkv knows are registered in :mod:`qkv.runs.kinds`.

A kind is light: what inference and serving need (its name, its model, its data sources) is
plain data, and its training hooks are :class:`Hook` objects that import the module defining them
only when first called, so importing the registry imports no trainer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.inference.kinds import ModelKind

if TYPE_CHECKING:
    from qkv.training.task import Task


@dataclass(frozen=True)
class Hook:
    """A run kind's training hook named by where it is defined, imported when first used.

    Args:
        path: ``"package.module:attribute"``, e.g. ``"qkv.runs.translation_kind:start_translation_run"``.
    """

    path: str

    def load(self) -> Any:
        """The object the path names (its module imported now, if it was not yet).

        Returns:
            The hook itself (a function or a class).
        """
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the hook with these arguments (its module imported first)."""
        return self.load()(*args, **kwargs)


def loaded(hook: Any) -> Any:
    """``hook`` itself, or what it names where it is a :class:`Hook`.

    Args:
        hook: one of a :class:`RunKind`'s hooks.

    Returns:
        The function or class.
    """
    return hook.load() if isinstance(hook, Hook) else hook


@dataclass(frozen=True, kw_only=True, eq=False)
class RunKind:
    """What one kind of run is.

    Attributes:
        model: the kind of model it trains (:class:`~qkv.inference.kinds.ModelKind`): its name as
            ``--task`` takes it and config.json stores it, its title, config class, tokenizer,
            serving kind and whether config.json stores the name (``stored``); read through the
            properties of the same names.
        sources: the data sources (``--data``) that train this kind; each source belongs to one kind.
        task_class: the training task (its batches, objective and validation).
        start: the kind's start hook, called by :func:`qkv.runs.lifecycle.start_run` with
            ``run_dir, data=, model_options=, train_options=, vocab_size=, overwrite=, device=,
            choice=`` and the keywords ``start_options`` returned; returns a ready Trainer.
        start_options: ``start_options(data, options)`` checks the kind's own start options
            (``options`` maps ``lm_options`` and ``decode`` to what was given) and returns the
            keywords for ``start``; raises ``ValueError`` for an option of another kind.
        open_task: ``open_task(run_dir, config, model_config)``: the task of a run folder being resumed.

    The hooks may be :class:`Hook` objects (imported when called: :func:`loaded` gives the object).
    Kinds compare by identity: each is registered once.
    """

    model: ModelKind
    sources: tuple[str, ...]
    task_class: Callable[..., Task]
    start: Callable[..., Any]
    start_options: Callable[[Any, Mapping[str, Any]], dict[str, Any]]
    open_task: Callable[[Path, dict, Any], Task]

    @property
    def name(self) -> str:
        """The kind's name (``--task``, config.json's ``"task"``)."""
        return self.model.name

    @property
    def title(self) -> str:
        """The kind in words ("translation", "language model")."""
        return self.model.title

    @property
    def serve_kind(self) -> str:
        """The explorer's and ``qkv serve``'s name for this kind of model."""
        return self.model.serve_kind

    @property
    def model_config(self) -> type:
        """The model's config class (config.json's ``"model"``)."""
        return self.model.model_config

    @property
    def stored(self) -> bool:
        """Whether config.json records ``"task": name``."""
        return self.model.stored

    def __repr__(self) -> str:
        return f"RunKind({self.name!r})"


__all__ = ["Hook", "RunKind", "loaded"]
