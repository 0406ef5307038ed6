"""Starting, resuming and finishing runs, by the names qkv 1.x gave them here: the lifecycle is
:mod:`qkv.runs.lifecycle` (one for every run kind), the translation kind's own part
:mod:`qkv.runs.translation_kind`. These are the same objects."""

from __future__ import annotations

from qkv.data.sources import data_fingerprint
from qkv.runs.lifecycle import resume_run, run_training, start_run
from qkv.runs.translation_kind import start_translation_run
from qkv.training import TrainingCrashed

__all__ = ["TrainingCrashed", "data_fingerprint", "resume_run", "run_training", "start_run", "start_translation_run"]
