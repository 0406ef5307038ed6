"""``qkv train``'s options, each declared once with the help group it is listed in.

Three tables: the data and run options below (:data:`CLI_OPTIONS`), the model options
(:data:`MODEL_OPTION_GROUPS`) and the :class:`~qkv.training.TrainConfig` fields marked for the
command line (their ``group`` metadata). ``qkv train --help`` lists the groups of
:data:`SHORT_HELP_GROUPS`; ``--help-all`` every group. Every option defaults to None, meaning "the
recipe's value", so that an explicit value can be told from the recipe's.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, NamedTuple

from qkv.cli.options import positive_int
from qkv.runs.kinds import kind_names
from qkv.training.config import OPTION_GROUPS, TrainConfig

# the headings of the groups, by name (TrainConfig's OPTION_GROUPS)
GROUP_TITLES = {
    "data": "data (one of --data, --prepared, --train-src/--train-tgt or --train-text)",
    "model": "model (fixed once a run exists)",
    "training": "training (with --resume: the run's own unless given)",
    "run": "run folder and budget (the budget: whichever of --minutes, --max-steps, --epochs ends first)",
    "advanced": "advanced (rarely needed)",
    "research": "research methods (off by default; did not help on Multi30k, see docs/history)",
}
SHORT_HELP_GROUPS = ("data", "model", "training", "run")  # --help; --help-all adds the others
assert set(GROUP_TITLES) == set(OPTION_GROUPS)

Container = argparse._ActionsContainer  # a parser or an argument group
Groups = Container | Mapping[str, Container]  # one container for all, or one per group name


@dataclass(frozen=True, kw_only=True)
class CliOption:
    """A ``qkv train`` option that is neither a model nor a :class:`~qkv.training.TrainConfig` field."""

    dest: str
    group: str  # one of OPTION_GROUPS
    help: str
    arguments: dict[str, Any] = field(default_factory=dict)  # add_argument's keywords besides help
    default: str | None = None  # what it defaults to, for the help, where no recipe sets it

    @property
    def flag(self) -> str:
        """The option's command-line flag: ``dest`` with dashes, e.g. ``--src-lang``."""
        return flag_of(self.dest)


class ModelOption(NamedTuple):
    """A model option: the model field it sets for each kind of model (None where it does not apply)."""

    translation_field: str | None
    lm_field: str | None
    kind: type
    help: str


LM_OPTIONS = ("tokenizer", "windows")  # language-model options that are neither model nor TrainConfig fields
TASKS = kind_names()  # ("translation", "lm"): the registered run kinds
_FILE = {"metavar": "FILE"}
CLI_OPTIONS: tuple[CliOption, ...] = (
    CliOption(
        dest="data",
        group="data",
        help="a known data set (tinyshakespeare: a language model)",
        arguments={"choices": ["multi30k", "dates", "tinyshakespeare"]},
    ),
    CliOption(
        dest="src_lang",
        group="data",
        help="Multi30k source language",
        arguments={"choices": ["en", "de", "fr"]},
        default="en",
    ),
    CliOption(
        dest="tgt_lang",
        group="data",
        help="Multi30k target language",
        arguments={"choices": ["en", "de", "fr"]},
        default="de",
    ),
    CliOption(
        dest="train_src", group="data", help="training source file, one sentence a line (.gz allowed)", arguments=_FILE
    ),
    CliOption(
        dest="train_tgt", group="data", help="training target file, line-aligned with --train-src", arguments=_FILE
    ),
    CliOption(dest="val_src", group="data", help="validation source file (optional)", arguments=_FILE),
    CliOption(dest="val_tgt", group="data", help="validation target file", arguments=_FILE),
    CliOption(dest="train_text", group="data", help="UTF-8 text to train a language model on", arguments=_FILE),
    CliOption(
        dest="prepared",
        group="data",
        help="a prepared folder made by qkv prepare (its tokenizer, training and validation pairs; "
        "every process reads it a batch at a time)",
        arguments={"metavar": "DIR"},
    ),
    CliOption(
        dest="task",
        group="advanced",
        help="what to train; given, it must agree with the data",
        arguments={"choices": TASKS},
        default="what the data is for: a language model for tinyshakespeare and --train-text, else translation",
    ),
    CliOption(
        dest="data_dir",
        group="advanced",
        help="folder with the Multi30k files or tiny Shakespeare's input.txt",
        arguments={"metavar": "DIR"},
        default="$QKV_DATA/multi30k or $QKV_DATA/tinyshakespeare, the cache, or a download",
    ),
    CliOption(
        dest="val_text",
        group="advanced",
        help="validation text for --train-text",
        arguments=_FILE,
        default="--train-text cut by position: its first 90%% of characters train, the next 5%% "
        "validate, the last 5%% are the test split",
    ),
    CliOption(
        dest="test_text",
        group="advanced",
        help="test text, with --val-text (without it, the run has no test split); training never "
        "reads it: qkv evaluate scores it",
        arguments=_FILE,
    ),
    CliOption(
        dest="tokenizer",
        group="advanced",
        help="a language model's tokens: characters or byte-level BPE (--vocab-size)",
        arguments={"choices": ["char", "bpe"]},
    ),
    CliOption(
        dest="windows",
        group="advanced",
        help="a language model's training windows: random offsets or non-overlapping",
        arguments={"choices": ["random", "strided"]},
    ),
    CliOption(
        dest="both_directions",
        group="research",
        help="translation from text: train on the pairs and on the same pairs reversed (one model "
        "for both ways; validation stays in the given direction)",
        arguments={"action": "store_true", "default": None},
    ),
    CliOption(
        dest="run_dir",
        group="run",
        help="the run folder (created; it must not exist unless --resume or --overwrite)",
        arguments={"required": True, "metavar": "DIR"},
    ),
    CliOption(
        dest="resume",
        group="run",
        help="continue the run in --run-dir where it stopped",
        arguments={"action": "store_true"},
    ),
    CliOption(
        dest="overwrite",
        group="run",
        help="replace --run-dir if it is a qkv run folder (or empty), once every check has passed",
        arguments={"action": "store_true"},
    ),
    CliOption(
        dest="trust_checkpoint",
        group="advanced",
        help="with --resume: load a state.pt that holds pickled Python objects (written by an older "
        "qkv) in full, once, and rewrite it in the safe form; loading such a file can run any "
        "code, so only for a run you made yourself",
        arguments={"action": "store_true"},
    ),
    CliOption(
        dest="threads",
        group="advanced",
        help="CPU threads",
        arguments={"type": positive_int, "default": None, "metavar": "N"},
        default="all cores",
    ),
    CliOption(
        dest="device",
        group="advanced",
        help="cpu, cuda or cuda:N",
        arguments={"default": None},
        default="cuda when available",
    ),
    CliOption(dest="no_progress", group="advanced", help="no progress bar", arguments={"action": "store_true"}),
)
DATA_OPTIONS = (  # what a resumed run keeps: given with --resume, an error
    "task",
    "data",
    "prepared",
    "data_dir",
    "src_lang",
    "tgt_lang",
    "train_src",
    "train_tgt",
    "val_src",
    "val_tgt",
    "train_text",
    "val_text",
    "test_text",
    "vocab_size",
    "recipe",
    "both_directions",
    *LM_OPTIONS,
)

VOCAB_SIZE_HELP = "BPE vocabulary size (a language model: with --tokenizer bpe only)"
# command-line option -> the TransformerConfig and CausalLMConfig field it sets (None where the
# option does not apply to that kind of model), by the help group it is listed in
MODEL_OPTION_GROUPS: dict[str, dict[str, ModelOption]] = {
    "model": {
        "d_model": ModelOption("d_model", "d_model", int, "model width"),
        "heads": ModelOption("num_heads", "num_heads", int, "attention heads; must divide --d-model"),
        "encoder_layers": ModelOption("num_encoder_layers", None, int, "encoder layers (translation)"),
        "decoder_layers": ModelOption("num_decoder_layers", None, int, "decoder layers (translation)"),
        "layers": ModelOption(None, "num_layers", int, "layers of a language model"),
        "dropout": ModelOption("dropout", "dropout", float, "residual and embedding dropout, in [0, 1)"),
    },
    "advanced": {
        "d_ff": ModelOption("d_ff", "d_ff", int, "inner width of the feed-forward layers"),
        "attention_dropout": ModelOption(
            "attention_dropout",
            "attention_dropout",
            float,
            "dropout on the attention weights, in [0, 1) (not in the paper)",
        ),
        "activation": ModelOption(
            "activation",
            "activation",
            str,
            "feed-forward activation: relu, gelu, gelu_tanh, relu2, silu, or gated: swiglu, geglu",
        ),
        "norm": ModelOption("norm", "norm", str, "the layers' norms: layer (LayerNorm) or rms (RMSNorm)"),
        "positional": ModelOption(
            "positional",
            "positional",
            str,
            "positions: sinusoidal, learned or none; a language model also rotary or alibi",
        ),
        "kv_heads": ModelOption(
            "num_kv_heads", "num_kv_heads", int, "key/value heads (grouped-query attention); must divide --heads"
        ),
        "sliding_window": ModelOption(
            None, "sliding_window", int, "a language model's sliding window: tokens each one sees, itself included"
        ),
        "qk_norm": ModelOption(None, "qk_norm", bool, "a norm over each head's queries and keys (a language model)"),
        "bias": ModelOption(
            None, "bias", bool, "biases in the attention and feed-forward projections (a language model)"
        ),
        "norm_first": ModelOption("norm_first", "norm_first", bool, "pre-LN instead of the paper's post-LN"),
        "max_len": ModelOption(
            "max_len",
            None,
            int,
            "longest sequence in tokens (translation; longer training pairs are dropped, with a count)",
        ),
        "context": ModelOption(None, "context", int, "tokens a language model attends over (its training windows)"),
        "share_embeddings": ModelOption("share_embeddings", None, bool, "one embedding table for source and target"),
    },
}
MODEL_OPTIONS: dict[str, ModelOption] = {
    name: option for options in MODEL_OPTION_GROUPS.values() for name, option in options.items()
}


def flag_of(dest: str) -> str:
    """The command-line flag of an option without one of its own: ``--dest-with-dashes``."""
    return "--" + dest.replace("_", "-")


def train_fields() -> Iterator[tuple[Field[Any], str]]:
    """The :class:`~qkv.training.TrainConfig` fields that are command-line options, with their flags."""
    for f in fields(TrainConfig):
        if f.metadata.get("cli"):
            yield f, f.metadata["flag"] or flag_of(f.name)


def declared_help() -> dict[str, str]:
    """``{dest: help}`` of every option declared here (without where its default comes from)."""
    out = {option.dest: option.help for option in CLI_OPTIONS}
    out["vocab_size"] = VOCAB_SIZE_HELP
    out.update({name: option.help for name, option in MODEL_OPTIONS.items()})
    out.update({f.name: f.metadata["help"] for f, _ in train_fields()})
    return out


def _container(groups: Groups, name: str) -> Container:
    return groups[name] if isinstance(groups, Mapping) else groups


def _noted(help_text: str, dest: str, notes: Mapping[str, str] | None) -> str:
    return help_text + (notes or {}).get(dest, "")


def add_cli_options(groups: Groups, *, notes: Mapping[str, str] | None = None) -> None:
    """The data and run options (:data:`CLI_OPTIONS`), each in its group.

    Args:
        groups: one container for all, or ``{group name: container}``.
        notes: ``{dest: text}`` appended to an option's help (where its default comes from).
    """
    for option in CLI_OPTIONS:
        _container(groups, option.group).add_argument(
            option.flag, dest=option.dest, help=_noted(option.help, option.dest, notes), **option.arguments
        )


def add_model_arguments(
    groups: Groups, *, translation_only: bool = False, notes: Mapping[str, str] | None = None
) -> None:
    """``--vocab-size`` and the model options (:data:`MODEL_OPTIONS`): declared here once, for ``qkv
    train`` and the training benchmarks.

    Args:
        groups: one container for all, or ``{group name: container}``.
        translation_only: only the options of a translation model.
        notes: ``{dest: text}`` appended to an option's help (where its default comes from).
    """
    _container(groups, "model").add_argument(
        "--vocab-size", type=int, metavar="N", help=_noted(VOCAB_SIZE_HELP, "vocab_size", notes)
    )
    for group, options in MODEL_OPTION_GROUPS.items():
        for name, option in options.items():
            if translation_only and option.translation_field is None:
                continue
            help_text = _noted(option.help, name, notes)
            if option.kind is bool:
                _container(groups, group).add_argument(
                    flag_of(name), action=argparse.BooleanOptionalAction, help=help_text
                )
            else:
                metavar = {int: "N", float: "X"}.get(option.kind)
                _container(groups, group).add_argument(flag_of(name), type=option.kind, metavar=metavar, help=help_text)


def add_train_arguments(groups: Groups, *, notes: Mapping[str, str] | None = None) -> None:
    """One option per :class:`~qkv.training.TrainConfig` field marked for the command line (each
    declared once, on the field, with its group), defaulting to None: the recipe's value.

    Args:
        groups: one container for all, or ``{group name: container}``.
        notes: ``{dest: text}`` appended to an option's help (where its default comes from).
    """
    for f, flag in train_fields():
        group = _container(groups, f.metadata["group"])
        help_text = _noted(f.metadata["help"], f.name, notes)
        if f.type == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        elif f.metadata.get("choices"):
            group.add_argument(flag, dest=f.name, choices=f.metadata["choices"], help=help_text)
        else:
            kind, metavar = (int, "N") if f.type == "int" else (float, "X")
            group.add_argument(flag, dest=f.name, type=kind, metavar=metavar, help=help_text)


def train_options_from(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~qkv.training.TrainConfig` fields given on the command line."""
    return {f.name: getattr(args, f.name) for f, _ in train_fields() if getattr(args, f.name) is not None}


def model_options_from(args: argparse.Namespace, *, is_lm: bool) -> dict[str, Any]:
    """The model options given, as fields of the kind of model the data trains; an option of the
    other kind is an error."""
    options = {}
    for name, option in MODEL_OPTIONS.items():
        if getattr(args, name, None) is None:  # not given (or not declared: add_model_arguments(translation_only))
            continue
        model_field = option.lm_field if is_lm else option.translation_field
        if model_field is None:
            kind = "a language model" if is_lm else "a translation model"
            raise ValueError(f"{flag_of(name)} is not an option of {kind}")
        options[model_field] = getattr(args, name)
    return options
