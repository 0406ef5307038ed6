"""Run folders: what one holds and how it is recognised and loaded (:mod:`~qkv.runs.folder`), the
recipes runs start from (:mod:`~qkv.runs.recipes`), the kinds of run (:mod:`~qkv.runs.kinds`: a
translation run, :mod:`~qkv.runs.translation_kind`, or a language-model run,
:mod:`~qkv.runs.language_model`), and starting, resuming and finishing a run of any kind
(:mod:`~qkv.runs.lifecycle`)."""

from qkv.runs.folder import is_run_folder, load_run, read_run_config
from qkv.runs.lifecycle import resume_run, run_training, start_run

__all__ = ["is_run_folder", "load_run", "read_run_config", "resume_run", "run_training", "start_run"]
