"""Training options and where a run stands (the schedules are in :mod:`qkv.training.schedule`).

:class:`TrainConfig` declares every training option once: its default, its command-line help and
flag, the help group it is listed in, and its allowed range (``qkv train``'s flags are made from
these fields, and the same checks run for the CLI and the Python API).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

#: where ``qkv train`` lists an option: ``--help`` shows data, model, training and run (what most runs
#: set); ``--help-all`` adds advanced (rarely needed) and research (methods tried that did not help)
OPTION_GROUPS = ("data", "model", "training", "run", "advanced", "research")

# The largest counts a run takes, declared once (each field's ``maximum``, which qkv train's flags
# and recipes are checked against like the rest of its range), so a typo is refused in one line
# before anything is allocated rather than ending in an out-of-memory kill after the run folder exists.
#: tokens of one batch: the largest per-device batches in use hold about a million; 2**24 is 16x that
MAX_BATCH_TOKENS = 2**24
#: batches summed into one step (a step of 2**16 of MAX_BATCH_TOKENS batches is 10**12 tokens)
MAX_ACCUM_STEPS = 2**16
#: step counts (budget, warmup, intervals): about 10**12, years of steps at any speed
MAX_STEPS = 2**40
#: validation sentences or windows, and kept checkpoints averaged (each is a model-sized file)
MAX_EVAL_SENTENCES = 2**24
MAX_AVERAGED = 1024
#: seeds: what every random number generator qkv seeds accepts (numpy's legacy one takes 32 bits)
MAX_SEED = 2**32 - 1


def _option(
    default: Any,
    help: str,
    *,
    group: str,
    flag: str | None = None,
    minimum: float | None = None,
    below: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
    cli: bool = True,
) -> Any:
    """A :class:`TrainConfig` field with everything the CLI and the checks need, declared once.

    Args:
        default: the value when neither a recipe nor the caller sets one.
        help: the command-line help (``qkv train`` adds where the default comes from).
        group: one of :data:`OPTION_GROUPS`: where ``qkv train --help`` (or ``--help-all``) lists it.
        flag: the command-line flag (default ``--field-name``).
        minimum, below, maximum: the allowed range (``>= minimum``, ``< below``, ``<= maximum``).
        choices: the allowed values of a string field.
        cli: whether ``qkv train`` has a flag for it.

    Returns:
        A dataclass field whose metadata holds the above.
    """
    if group not in OPTION_GROUPS:
        raise ValueError(f"group must be one of {', '.join(OPTION_GROUPS)}, got {group!r}")
    meta = {
        "help": help,
        "group": group,
        "flag": flag,
        "minimum": minimum,
        "below": below,
        "maximum": maximum,
        "choices": choices,
        "cli": cli,
    }
    if isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Options of a training run (saved in the run's config.json). Each field's metadata holds its
    command-line help and allowed range: ``qkv train``'s flags are made from these fields."""

    # every recipe sets max_tokens (the paper's from their tokens a step), so a qkv train run never
    # takes this 6000: it is the Python API's value for a TrainConfig built without a recipe
    max_tokens: int = _option(
        6000,
        "padded tokens per batch (sentences x longest source or target; a language "
        "model: max_tokens // context windows)",
        minimum=1,
        maximum=MAX_BATCH_TOKENS,
        group="training",
    )
    accum_steps: int = _option(
        1,
        "batches whose gradients are summed into one optimizer step",
        minimum=1,
        maximum=MAX_ACCUM_STEPS,
        group="advanced",
    )
    lr_factor: float = _option(
        1.0,
        "multiplies the paper's schedule d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)",
        minimum=0,
        below=math.inf,
        group="training",
    )
    warmup_steps: int = _option(
        800,
        "linear warmup steps of the inverse-sqrt schedule (the paper: 4000)",
        flag="--warmup",
        minimum=1,
        maximum=MAX_STEPS,
        group="training",
    )
    schedule: str = _option(
        "inverse_sqrt",
        "learning-rate schedule: inverse_sqrt = the paper's (section 5.3); "
        "budget = the paper's, brought down linearly to zero over the last "
        "--decay-fraction of the run's budget (--minutes, --max-steps or "
        "--epochs, whichever ends first); cosine = the paper's warmup to its peak, then half a cosine "
        "down to zero at the budget's end",
        choices=("inverse_sqrt", "budget", "cosine"),
        group="advanced",
    )
    decay_fraction: float = _option(
        1.0,
        "with --schedule budget: the share of the budget, at its end, over which the rate falls to zero",
        minimum=0.01,
        maximum=1,
        group="advanced",
    )
    adam_betas: tuple[float, float] = _option(
        (0.9, 0.98), "Adam's beta1 and beta2 (section 5.3)", cli=False, group="advanced"
    )
    adam_eps: float = _option(1e-9, "Adam's epsilon", minimum=0, below=math.inf, cli=False, group="advanced")
    weight_decay: float = _option(
        0.0,
        "decoupled weight decay (AdamW, Loshchilov & Hutter 2019): each step shrinks the "
        "weight matrices and embeddings by learning rate x this (e.g. 0.1); biases and "
        "layer-norm gains are not decayed (0 = off: Adam, as the paper)",
        minimum=0,
        below=math.inf,
        group="advanced",
    )
    optimizer: str = _option(
        "adamw",
        "adamw = Adam (section 5.3), or AdamW with --weight-decay, for every parameter; muon = Muon "
        "(momentum orthogonalised by a Newton-Schulz iteration; torch.optim.Muon's algorithm, the iteration in "
        "float32 on a CPU) for the weight "
        "matrices of the layers (attention and feed-forward), with AdamW as adamw for the "
        "embeddings, the output projection, norms and biases; --weight-decay applies to both",
        choices=("adamw", "muon"),
        group="advanced",
    )
    muon_lr: float = _option(
        0.02,
        "with --optimizer muon: Muon's learning rate at the schedule's peak; the schedule scales it "
        "as it scales AdamW's (Muon's rate = this x the schedule's rate / its peak)",
        minimum=0,
        below=math.inf,
        group="advanced",
    )
    muon_momentum: float = _option(
        0.95, "with --optimizer muon: Muon's momentum (Nesterov)", minimum=0, below=1, group="advanced"
    )
    label_smoothing: float = _option(0.1, "label smoothing epsilon (section 5.4)", minimum=0, below=1, group="advanced")
    rdrop: float = _option(
        0.0,
        "R-Drop (Liang et al. 2021): run each batch twice, each with its own dropout, and add "
        "this weight times the symmetric KL divergence of the two predictions to their mean "
        "loss (e.g. 3; 0 = off; the logged training loss includes it); a step costs about "
        "twice as much",
        minimum=0,
        below=math.inf,
        group="research",
    )
    rdrop_start: float = _option(
        0.0,
        "with --rdrop: the share of the budget (as --schedule budget counts it) spent "
        "before R-Drop starts; the steps before it run each batch once (0 = from the "
        "first step)",
        minimum=0,
        below=1,
        group="research",
    )
    dropout_start: float = _option(
        0.0,
        "late dropout (Liu et al. 2023): the share of the budget (as --schedule budget "
        "counts it) spent before the model's dropout starts; the steps before it train "
        "with every dropout at 0, which learns faster and costs less per step (0 = "
        "dropout from the first step)",
        minimum=0,
        below=1,
        group="research",
    )
    both_directions_until: float = _option(
        1.0,
        "translation with --both-directions: the share of the budget (as "
        "--schedule budget counts it) after which training goes on with the "
        "given direction alone, from the next epoch on (bidirectional "
        "pretraining, Ding et al. 2021; 1 = both ways all the run)",
        minimum=0,
        maximum=1,
        group="research",
    )
    subword_dropout: float = _option(
        0.0,
        "translation: split each training token into the two pieces its BPE merge "
        "joined with this probability, and each piece again, afresh every epoch "
        "(a regulariser like BPE-dropout; 0 = off)",
        minimum=0,
        below=1,
        group="research",
    )
    clip_norm: float = _option(
        1.0, "gradient clipping on the global norm (0 = off)", minimum=0, below=math.inf, group="advanced"
    )
    bf16: bool = _option(
        False,
        "bfloat16 autocast (weights and the optimizer stay float32); fast on CUDA and on CPUs with AVX512-BF16/AMX",
        group="training",
    )
    compile: bool = _option(
        False,
        "torch.compile the encoder and decoder (the fused loss stays eager); on a "
        "2-core CPU it made the step slower, see the README",
        group="advanced",
    )
    max_steps: int = _option(
        0, "stop after this many optimizer steps (0 = no limit)", minimum=0, maximum=MAX_STEPS, group="run"
    )
    max_epochs: float = _option(
        0.0,
        "stop after this many passes over the data (0 = no limit)",
        flag="--epochs",
        minimum=0,
        below=math.inf,
        group="run",
    )
    max_minutes: float = _option(
        0.0,
        "stop after this much wall time over all sessions, validation included (0 = no limit)",
        flag="--minutes",
        minimum=0,
        below=math.inf,
        group="run",
    )
    eval_every_steps: int = _option(
        0, "validate every N steps (0 = off)", minimum=0, maximum=MAX_STEPS, group="advanced"
    )
    eval_every_minutes: float = _option(
        0.0, "validate every N minutes (0 = off)", minimum=0, below=math.inf, group="advanced"
    )
    eval_sentences: int = _option(
        300,
        "validation sentences decoded greedily for BLEU (a language model: validation windows)",
        minimum=1,
        maximum=MAX_EVAL_SENTENCES,
        group="advanced",
    )
    stop_at_exact_match: float = _option(
        0.0,
        "stop once validation exact match reaches this fraction (0 = off)",
        minimum=0,
        maximum=1,
        cli=False,
        group="advanced",
    )
    checkpoint_every_steps: int = _option(
        0, "keep a checkpoint for averaging every N steps (0 = off)", minimum=0, maximum=MAX_STEPS, group="advanced"
    )
    checkpoint_every_minutes: float = _option(
        0.0, "... or every N minutes (0 = off)", minimum=0, below=math.inf, group="advanced"
    )
    average_last: int = _option(
        5,
        "average this many kept checkpoints at the end (<= 1: no averaging)",
        minimum=0,
        maximum=MAX_AVERAGED,
        group="advanced",
    )
    ema_decay: float = _option(
        0.0,
        "also keep an exponential moving average of the weights, updated after every "
        "step with this decay (e.g. 0.999; 0 = off), written to ema.safetensors at the "
        "end",
        minimum=0,
        below=1,
        group="advanced",
    )
    final_weights: str = _option(
        "average",
        "what model.safetensors holds at the end: average = the last "
        "--average-last kept checkpoints averaged (or the final weights); best = "
        "the weights of the best validation (best.safetensors; a run that "
        "overfits late keeps its best); ema = the moving average (--ema-decay)",
        choices=("average", "best", "ema"),
        group="advanced",
    )
    log_every_steps: int = _option(
        20, "write a training-loss line to metrics.jsonl every N steps", minimum=1, maximum=MAX_STEPS, group="advanced"
    )
    seed: int = _option(
        0, "drives the initial weights and the batch order", minimum=0, maximum=MAX_SEED, group="training"
    )
    progress: bool = _option(True, "tqdm progress bar", cli=False, group="advanced")
    strategy: str = _option(
        "ddp",
        "how several processes (torchrun) share the work: ddp = a full replica each, "
        "gradients averaged; fsdp = parameters, gradients and optimizer state sharded "
        "(FSDP2), for models that do not fit one device",
        choices=("ddp", "fsdp"),
        group="advanced",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, self.check_option(f.name, getattr(self, f.name)))

        if self.rdrop_start and not self.rdrop:
            raise ValueError("rdrop_start (--rdrop-start) says when R-Drop starts: set rdrop (--rdrop) too, e.g. 3")
        if self.rdrop and self.rdrop_start < self.dropout_start:
            raise ValueError(
                "R-Drop compares two dropout masks: rdrop_start (--rdrop-start) must not come before "
                "dropout_start (--dropout-start)"
            )
        if self.optimizer == "muon" and self.strategy == "fsdp":
            raise ValueError(
                "optimizer (--optimizer) muon orthogonalises each weight matrix whole, and strategy (--strategy) "
                "fsdp shards them: use --strategy ddp, or --optimizer adamw"
            )
        if self.final_weights == "ema" and not self.ema_decay:
            raise ValueError(
                "final_weights (--final-weights) ema needs a moving average: set ema_decay (--ema-decay), e.g. 0.999"
            )

    @classmethod
    def check_option(cls, field_name: str, value: Any) -> Any:
        """One option's type and range, as its field declares them (``ValueError`` naming the option
        and its flag); ``qkv train`` checks the options given with it before anything else.

        Args:
            field_name: a TrainConfig field.
            value: its value.

        Returns:
            The value as the field holds it (a float field's integer as a float, a tuple field's list
            as a tuple).
        """
        f = next(f for f in fields(cls) if f.name == field_name)
        meta = f.metadata
        name = f"{f.name} ({meta['flag'] or '--' + f.name.replace('_', '-')})" if meta.get("cli") else f.name
        if meta.get("choices"):
            if value not in meta["choices"]:
                raise ValueError(f"{name} must be one of {', '.join(meta['choices'])}, got {value!r}")
            return value
        if f.type == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
            return value
        if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if f.type == "float":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            value = float(value)
        if f.type.startswith("tuple"):
            if not (
                isinstance(value, (tuple, list))
                and len(value) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value)
            ):
                raise ValueError(f"{name} must be two numbers in [0, 1), got {value!r}")
            return tuple(float(b) for b in value)
        low, below, high = meta.get("minimum"), meta.get("below"), meta.get("maximum")
        if (
            (low is not None and value < low)
            or (below is not None and value >= below)
            or (high is not None and value > high)
        ):
            allowed = f">= {low}" if low is not None else ""
            if below is not None and below != math.inf:
                allowed += f" and < {below}"
            elif below == math.inf:
                allowed += " and finite"
            if high is not None:
                allowed += f" and <= {high:,}"
            raise ValueError(f"{name} must be {allowed.strip()}, got {value!r}")
        return value

    def check_stops(self) -> None:
        """A run needs a stop condition; raises ``ValueError`` naming the options otherwise."""
        if not (self.max_steps or self.max_minutes or self.max_epochs):
            raise ValueError(
                "set at least one stop condition: max_steps (--max-steps), max_minutes (--minutes) "
                "or max_epochs (--epochs), each > 0"
            )

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """Build from a dict (e.g. config.json's ``train``); unknown keys or bad values raise ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"training options must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {unknown}")
        return cls(**data)


@dataclass
class TrainState:
    """Where a run stands; saved in state.pt with the weights, the optimizer and the RNG states."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current pass over the data
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    tokens: int = 0  # target tokens trained on
    seconds: float = 0.0  # wall time spent in the training loop (over all sessions)
    best_score: float = -math.inf  # the task's best validation score so far (BLEU; minus the loss for a language model)
    last_eval_seconds: float = 0.0
    last_eval_step: int = -1  # the step of the last validation (the budget's end is validated once)
    last_checkpoint_seconds: float = 0.0
    kept_checkpoints: list | None = None
    stopped_early: bool = False  # a stop_at_exact_match target was reached
    metrics_bytes: int = 0  # length of metrics.jsonl at this step (lines after it are cut on resume)
    one_way_from_epoch: int = -1  # --both-directions-until: the first epoch without the reversed pairs (-1: none yet)
