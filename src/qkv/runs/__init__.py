"""Run folders: what one holds and how it is recognised and loaded (:mod:`~qkv.runs.folder`), the
recipes runs start from (:mod:`~qkv.runs.recipes`), the kinds of run (:mod:`~qkv.runs.kinds`: a
translation run, :mod:`~qkv.runs.translation_kind`, or a language-model run,
:mod:`~qkv.runs.language_model`), and starting, resuming and finishing a run of any kind
(:mod:`~qkv.runs.lifecycle`).

The lifecycle's names are imported when first used, so that importing the light modules here (the
registry of kinds, the run folder's loading half) imports no trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qkv.runs.folder import is_run_folder, load_run, read_run_config

if TYPE_CHECKING:
    from qkv.runs.lifecycle import resume_run, run_training, start_run

_LIFECYCLE = ("resume_run", "run_training", "start_run")


def __getattr__(name: str) -> Any:
    """``start_run``, ``resume_run`` and ``run_training``, from :mod:`qkv.runs.lifecycle` (imported now)."""
    if name in _LIFECYCLE:
        from qkv.runs import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["is_run_folder", "load_run", "read_run_config", "resume_run", "run_training", "start_run"]
