"""Training: one engine for every task, on one process or many.

- :mod:`qkv.training.config`: :class:`TrainConfig` (every option declared once), the schedule,
  :class:`TrainState`;
- :mod:`qkv.training.tasks`: what a kind of model trains on (:class:`TranslationTask`,
  :class:`LanguageModelTask`);
- :mod:`qkv.training.objectives`: what a step minimises, chosen by name (:class:`LabelSmoothedCrossEntropy`,
  the default; :class:`RDrop`, whose maths is :mod:`qkv.training.rdrop`);
- :mod:`qkv.training.hooks`: :class:`~qkv.training.hooks.StepHook`, where a research method meets the
  loop outside the step's body;
- :mod:`qkv.training.methods`: the research methods scheduled over the budget, each a step hook (R-Drop's
  start, late dropout, both directions until; subword dropout, set on the task);
- :mod:`qkv.training.engine`: :class:`Trainer` (``step``, the loop, validation, the final weights);
- :mod:`qkv.training.checkpointing`: :class:`~qkv.training.checkpointing.Checkpoints`, the object the
  Trainer owns for its run folder (save, resume, the last whole step after a stop or failure, the
  checkpoints kept for averaging, the final weights);
- :mod:`qkv.training.distributed`: torchrun's process group, DDP and FSDP2.

Run folders (creating, resuming, recipes) are in :mod:`qkv.runs.translation`.
"""

from qkv.training.config import TrainConfig, TrainState
from qkv.training.distributed import Distributed, init_distributed
from qkv.training.engine import StepStats, Trainer, TrainingCrashed
from qkv.training.objectives import (
    OBJECTIVES,
    LabelSmoothedCrossEntropy,
    Objective,
    Predictions,
    RDrop,
    make_objective,
    step_objective,
)
from qkv.training.schedule import inverse_sqrt_lr
from qkv.training.tasks import LanguageModelTask, TranslationTask, encode_pairs

__all__ = [
    "OBJECTIVES",
    "Distributed",
    "LabelSmoothedCrossEntropy",
    "LanguageModelTask",
    "Objective",
    "Predictions",
    "RDrop",
    "StepStats",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainingCrashed",
    "TranslationTask",
    "encode_pairs",
    "init_distributed",
    "inverse_sqrt_lr",
    "make_objective",
    "step_objective",
]
