"""The kinds of model a run folder holds, as opening and serving one needs to know them: the name
config.json stores, the model's config class, its tokenizer, the explorer's and ``qkv serve``'s
name for it, and the commands that use it.

Each kind of run (:mod:`qkv.runs.kinds`) trains one of these; this half of a kind sits below the
trainer, so ``qkv translate``, ``qkv generate``, ``qkv serve`` and the exporters tell a run folder's
kind without importing :mod:`qkv.training`. A folder's kind is read from config.json's ``"task"``
(:func:`model_kind`); a folder without one is a translation run, as every run folder before
language models was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.data.text import load_text_tokenizer
from qkv.data.tokenizer import Tokenizer
from qkv.models.causal_lm import CausalLMConfig
from qkv.models.transformer import TransformerConfig

# config.json's section of a language-model run's own settings (tokenizer, windows, splits)
LM_SECTION = "lm"


@dataclass(frozen=True, kw_only=True)
class ModelKind:
    """One kind of model a run folder holds.

    Attributes:
        name: config.json's ``"task"`` for it (and ``qkv train --task``'s choice).
        title: the kind in words ("translation", "language model").
        serve_kind: the explorer's and ``qkv serve``'s name for this kind of model (a pretrained
            folder of the same family has it too).
        model_config: the model's config class (config.json's ``"model"``).
        load_tokenizer: reads the run's ``tokenizer.json``.
        commands: the commands that use a run of this kind, for an error that names them.
        stored: whether config.json records ``"task": name`` (False for the default kind, whose
            run folders have never stored it).
    """

    name: str
    title: str
    serve_kind: str
    model_config: type
    load_tokenizer: Callable[[Path], Any]
    commands: str
    stored: bool = True

    @property
    def run_words(self) -> str:
        """A run of this kind in words: "a translation run", "a language-model run"."""
        return f"a {self.title.replace(' ', '-')} run"


SEQ2SEQ = ModelKind(
    name="translation",
    title="translation",
    serve_kind="seq2seq",
    model_config=TransformerConfig,
    load_tokenizer=Tokenizer.load,
    commands="qkv translate / qkv evaluate",
    stored=False,
)
CAUSAL_LM = ModelKind(
    name="lm",
    title="language model",
    serve_kind="lm",
    model_config=CausalLMConfig,
    load_tokenizer=load_text_tokenizer,
    commands="qkv generate / qkv evaluate",
)

# the kind of a run folder whose config.json names none (0.1 and 1.x translation runs)
DEFAULT_KIND = SEQ2SEQ

MODEL_KINDS: dict[str, ModelKind] = {kind.name: kind for kind in (SEQ2SEQ, CAUSAL_LM)}


def register_model_kind(kind: ModelKind) -> ModelKind:
    """Register a kind of model (:func:`qkv.runs.kinds.register_kind` does, for a new run kind's).

    Args:
        kind: the kind; a name registered already must be this same kind.

    Returns:
        ``kind``.

    Raises:
        ValueError: another kind of that name is registered.
    """
    known = MODEL_KINDS.setdefault(kind.name, kind)
    if known is not kind:
        raise ValueError(f"a kind of model named {kind.name!r} is registered already")
    return kind


def kind_name(config: dict) -> str:
    """The kind's name a run folder's config.json gives (``"task"``; the default kind's when absent).

    Args:
        config: the run's config.json, read.

    Returns:
        The name, registered or not.
    """
    return config.get("task", DEFAULT_KIND.name)


def model_kind(config: dict, where: str | Path = "config.json") -> ModelKind:
    """The kind of model a run folder holds, from its config.json.

    Args:
        config: the run's config.json, read.
        where: the file, for the error.

    Returns:
        The registered kind.

    Raises:
        ValueError: a ``"task"`` no registered kind has.
    """
    name = kind_name(config)
    found = MODEL_KINDS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"{where}: unknown task {name!r}; qkv knows {', '.join(MODEL_KINDS)}")
    return found


__all__ = [
    "CAUSAL_LM",
    "DEFAULT_KIND",
    "LM_SECTION",
    "MODEL_KINDS",
    "SEQ2SEQ",
    "ModelKind",
    "kind_name",
    "model_kind",
    "register_model_kind",
]
