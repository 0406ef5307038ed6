""":class:`RunKind`: one kind of run (translation, language model) stated once.

A kind names what differs between runs of different models; everything else (checking options,
creating the folder whole or not at all, resuming, finishing) is the one lifecycle in
:mod:`qkv.runs.lifecycle`. The kinds qkv knows are registered in :mod:`qkv.runs.kinds`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.training.task import Task


@dataclass(frozen=True)
class RunKind:
    """What one kind of run is.

    Attributes:
        name: the kind's name, as ``--task`` takes it and as a run folder's config.json stores it
            under ``"task"`` (a translation run, the default, stores none: see ``stored``).
        title: the kind in words ("translation", "language model").
        sources: the data sources (``--data``) that train this kind; each source belongs to one kind.
        model_config: the model's config class (config.json's ``"model"``).
        task_class: the training task (its batches, objective and validation).
        serve_kind: the explorer's and ``qkv serve``'s name for this kind of model.
        start: the kind's start hook, called by :func:`qkv.runs.lifecycle.start_run` with
            ``run_dir, data=, model_options=, train_options=, vocab_size=, overwrite=, device=,
            choice=`` and the keywords ``start_options`` returned; returns a ready Trainer.
        start_options: ``start_options(data, options)`` checks the kind's own start options
            (``options`` maps ``lm_options`` and ``decode`` to what was given) and returns the
            keywords for ``start``; raises ``ValueError`` for an option of another kind.
        open_task: ``open_task(run_dir, config, model_config)``: the task of a run folder being resumed.
        stored: whether config.json records ``"task": name`` (False for the default kind, whose
            run folders have never stored it).
    """

    name: str
    title: str
    sources: tuple[str, ...]
    model_config: type
    task_class: type
    serve_kind: str
    start: Callable[..., Any]
    start_options: Callable[[Any, Mapping[str, Any]], dict[str, Any]]
    open_task: Callable[[Path, dict, Any], Task]
    stored: bool = True


__all__ = ["RunKind"]
