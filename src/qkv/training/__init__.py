"""Training: one engine for every task, on one process or many.

- :mod:`qkv.training.config`: :class:`TrainConfig` (every option declared once), the schedule,
  :class:`TrainState`;
- :mod:`qkv.training.tasks`: what a kind of model trains on (:class:`TranslationTask`,
  :class:`LanguageModelTask`);
- :mod:`qkv.training.engine`: :class:`Trainer` (``step``, the loop, validation, the final weights);
- :mod:`qkv.training.checkpointing`: the Trainer's run-folder checkpoints (save, resume, the last
  whole step after a stop or failure, the checkpoints kept for averaging);
- :mod:`qkv.training.distributed`: torchrun's process group, DDP and FSDP2.

Run folders (creating, resuming, recipes) are in :mod:`qkv.runs.translation`.
"""

from qkv.training.config import TrainConfig, TrainState, inverse_sqrt_lr
from qkv.training.distributed import Distributed, init_distributed
from qkv.training.engine import StepStats, Trainer, TrainingCrashed
from qkv.training.tasks import LanguageModelTask, TranslationTask, encode_pairs

__all__ = [
    "Distributed",
    "LanguageModelTask",
    "StepStats",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainingCrashed",
    "TranslationTask",
    "encode_pairs",
    "init_distributed",
    "inverse_sqrt_lr",
]
