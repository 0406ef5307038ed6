"""The registry of run kinds: which kinds of run qkv trains, and the lookups that replace a switch
on the kind's name.

Each kind is one :class:`~qkv.runs.run_kind.RunKind`, stated here (:data:`TRANSLATION`,
:data:`LANGUAGE_MODEL`) and registered; its training hooks live in its own module
(:mod:`~qkv.runs.translation_kind`, :mod:`~qkv.runs.language_model`), imported only when a hook
is called, so importing this registry imports no trainer (``qkv serve`` and the explorer read it).
A run folder's kind is read from its config.json (:func:`run_kind`), a new run's from its data
source (:func:`kind_for_source`): each data source belongs to exactly one kind.
"""

from __future__ import annotations

from qkv.data.sources import SOURCES
from qkv.data.text import TEXT_SOURCES
from qkv.inference import kinds as model_kinds
from qkv.inference.kinds import CAUSAL_LM, SEQ2SEQ
from qkv.runs.run_kind import Hook, RunKind

TRANSLATION = RunKind(
    model=SEQ2SEQ,
    sources=SOURCES,
    task_class=Hook("qkv.training.tasks:TranslationTask"),
    start=Hook("qkv.runs.translation_kind:start_translation_run"),
    start_options=Hook("qkv.runs.translation_kind:start_options"),
    open_task=Hook("qkv.runs.translation_kind:open_task"),
)
"""A translation run: an encoder-decoder trained on pairs of sentences (:mod:`qkv.runs.translation_kind`)."""

LANGUAGE_MODEL = RunKind(
    model=CAUSAL_LM,
    sources=TEXT_SOURCES,
    task_class=Hook("qkv.training.language_model_task:LanguageModelTask"),
    start=Hook("qkv.runs.language_model:start_lm_run"),
    start_options=Hook("qkv.runs.language_model:start_options"),
    open_task=Hook("qkv.runs.language_model:open_task"),
)
"""A language-model run: a decoder-only model trained on a text (:mod:`qkv.runs.language_model`)."""

KINDS: dict[str, RunKind] = {}


def register_kind(kind: RunKind) -> RunKind:
    """Register a run kind (a test's, or a new module's).

    Args:
        kind: the kind; its name and its data sources must be new.

    Returns:
        ``kind``.

    Raises:
        ValueError: a name already registered, or a data source that belongs to another kind.

    Its kind of model is registered too (:func:`qkv.inference.kinds.register_model_kind`), so its
    run folders open for inference.
    """
    if kind.name in KINDS:
        raise ValueError(f"run kind {kind.name!r} is registered already")
    taken = {source: other.name for other in KINDS.values() for source in other.sources}
    shared = sorted(set(kind.sources) & set(taken))
    if shared:
        raise ValueError(f"run kind {kind.name!r}: data sources {shared} belong to {taken[shared[0]]!r}")
    model_kinds.register_model_kind(kind.model)
    KINDS[kind.name] = kind
    return kind


for _kind in (TRANSLATION, LANGUAGE_MODEL):
    register_kind(_kind)


def kind_named(name: str) -> RunKind:
    """The run kind called ``name`` (``--task``, config.json's ``"task"``).

    Args:
        name: e.g. ``"translation"`` or ``"lm"``.

    Returns:
        The registered kind.

    Raises:
        ValueError: no kind of that name.
    """
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown kind of run {name!r}; choose one of {', '.join(KINDS)}") from None


def run_kind(config: dict) -> RunKind:
    """The kind of a run folder, from its config.json (a run folder without ``"task"`` is a translation run).

    Args:
        config: the run's config.json, read.

    Returns:
        The registered kind.
    """
    return kind_named(model_kinds.kind_name(config))


def kind_for_source(source: str) -> RunKind:
    """The kind of run a data source (``--data``) trains.

    Args:
        source: e.g. ``"multi30k"``, ``"prepared"`` or ``"tinyshakespeare"``.

    Returns:
        The one kind whose sources hold ``source``.

    Raises:
        ValueError: a source no kind trains on.
    """
    for kind in KINDS.values():
        if source in kind.sources:
            return kind
    known = [s for kind in KINDS.values() for s in kind.sources]
    raise ValueError(f"unknown data source {source!r}; choose one of {', '.join(known)}")


def kind_names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order (``--task``'s choices)."""
    return tuple(KINDS)


__all__ = [
    "KINDS",
    "LANGUAGE_MODEL",
    "TRANSLATION",
    "RunKind",
    "kind_for_source",
    "kind_named",
    "kind_names",
    "register_kind",
    "run_kind",
]
