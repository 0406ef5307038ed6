"""Run folders: what one holds and how it is recognised and loaded (:mod:`~qkv.runs.folder`), the
recipes runs start from (:mod:`~qkv.runs.recipes`), and starting, resuming and finishing a
translation run (:mod:`~qkv.runs.translation`) or a language-model run
(:mod:`~qkv.runs.language_model`)."""

from qkv.runs.folder import is_run_folder, load_run, read_run_config
from qkv.runs.translation import resume_run, run_training, start_run

__all__ = ["is_run_folder", "load_run", "read_run_config", "resume_run", "run_training", "start_run"]
