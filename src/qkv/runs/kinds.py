"""The registry of run kinds: which kinds of run qkv trains, and the lookups that replace a switch
on the kind's name.

Each kind is one :class:`~qkv.runs.run_kind.RunKind`, defined in its own module
(:data:`~qkv.runs.translation_kind.TRANSLATION`, :data:`~qkv.runs.language_model.LANGUAGE_MODEL`)
and registered here. A run folder's kind is read from its config.json (:func:`run_kind`), a new
run's from its data source (:func:`kind_for_source`): each data source belongs to exactly one kind.
"""

from __future__ import annotations

from qkv.runs import folder as run_folder
from qkv.runs.language_model import LANGUAGE_MODEL
from qkv.runs.run_kind import RunKind
from qkv.runs.translation_kind import TRANSLATION

KINDS: dict[str, RunKind] = {}


def register_kind(kind: RunKind) -> RunKind:
    """Register a run kind (a test's, or a new module's).

    Args:
        kind: the kind; its name and its data sources must be new.

    Returns:
        ``kind``.

    Raises:
        ValueError: a name already registered, or a data source that belongs to another kind.
    """
    if kind.name in KINDS:
        raise ValueError(f"run kind {kind.name!r} is registered already")
    taken = {source: other.name for other in KINDS.values() for source in other.sources}
    shared = sorted(set(kind.sources) & set(taken))
    if shared:
        raise ValueError(f"run kind {kind.name!r}: data sources {shared} belong to {taken[shared[0]]!r}")
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
    return kind_named(run_folder.run_task(config))


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


__all__ = ["KINDS", "RunKind", "kind_for_source", "kind_named", "kind_names", "register_kind", "run_kind"]
