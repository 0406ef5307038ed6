"""Which positions carry a rule past the length they were trained on: rotary, sinusoidal, learned, ALiBi.

The task: a stream of random tokens where the answer at position ``t`` is the token ``k`` places back,
``x[t - k]``. The rule depends on the relative position only, so a model that has learned it in
relative terms can apply it at any position. Four tiny causal language models, the same but for
their positions, are trained on sequences of ``L`` tokens and tested on sequences of ``4 L``; the
accuracy is read position by position, so the positions beyond ``L`` (never seen in training) are
measured apart from those the model was trained on.

- learned: a table of ``4 L`` rows added to the input, of which only the first ``L`` are ever
  trained (the others keep their random initial values: the table cannot say more than it was taught);
- sinusoidal: the fixed table of the paper (section 3.5) added to the input;
- rotary: queries and keys rotated by their positions, so that ``q . k`` depends on ``i - j`` only;
- ALiBi: no positions, each head's scores lowered in proportion to the distance ``i - j``.

Under a causal mask the prediction at position ``t`` reads tokens ``0 .. t`` only, so one pass over
``4 L`` tokens gives the accuracy of every shorter length too.

Shape legend: ``b`` batch, ``n`` sequence length, ``L`` the trained length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from qkv.experiments.common import (
    ExperimentResult,
    Stopwatch,
    experiment_dir,
    new_figure,
    pick_device,
    rounded,
    save_figure,
    seeded,
    write_results,
)
from qkv.models.causal_lm import IGNORE, CausalLM, CausalLMConfig

NAME = "positions-extrapolation"
KINDS = ("learned", "sinusoidal", "rotary", "alibi")
STRETCHES = (1, 2, 4)  # evaluated lengths, in multiples of the trained length
SOLVED = 0.9  # accuracy at which a rule counts as learned (or kept)
LOST = 0.5  # accuracy below which it counts as lost


@dataclass(frozen=True)
class PositionsConfig:
    """Sizes of the positions-extrapolation experiment."""

    train_length: int = 64  # L: tokens per training sequence; evaluated at 1, 2 and 4 L
    offset: int = 2  # k: the answer at position t is the token at t - k
    vocab_size: int = 16  # random tokens, uniform
    d_model: int = 64  # model width
    num_heads: int = 4  # attention heads
    num_layers: int = 2  # blocks
    d_ff: int = 128  # feed-forward width
    batch_size: int = 32  # sequences per training step
    steps: int = 1000  # Adam steps per model (the same for every kind)
    lr: float = 3e-3  # AdamW learning rate, no weight decay
    grad_clip: float = 1.0  # gradient norm clipping
    log_every: int = 50  # training loss recorded every this many steps
    eval_size: int = 256  # fresh test sequences of 4 L tokens
    smooth: int = 8  # positions averaged per point of the figure's accuracy curve

    def __post_init__(self) -> None:
        if self.train_length < 2 or not 1 <= self.offset < self.train_length:
            raise ValueError(f"need train_length >= 2 and 1 <= offset < train_length, got {self}")
        if self.vocab_size < 2 or self.steps < 1 or self.log_every < 1 or self.eval_size < 1:
            raise ValueError(f"vocab_size must be >= 2 and steps, log_every, eval_size positive, got {self}")

    @property
    def eval_length(self) -> int:
        """The longest sequence tested: ``max(STRETCHES) * L``."""
        return max(STRETCHES) * self.train_length


QUICK = PositionsConfig(
    train_length=16, d_model=32, num_heads=4, d_ff=64, batch_size=16, steps=120, eval_size=64, smooth=4
)


def make_batch(config: PositionsConfig, size: int, length: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``size`` random sequences of ``length`` tokens and their targets.

    Returns:
        ``ids (b, n)`` int64 and ``targets (b, n)``: ``ids[:, t - k]`` at ``t >= k``, ``IGNORE`` before.
    """
    ids = torch.randint(0, config.vocab_size, (size, length), generator=generator)
    targets = torch.full_like(ids, IGNORE)
    targets[:, config.offset :] = ids[:, : -config.offset]
    return ids, targets


def build_model(config: PositionsConfig, positional: str) -> CausalLM:
    """A pre-LN causal LM (RMSNorm, GELU, no dropout) of ``4 L`` positions with ``positional`` positions."""
    return CausalLM(
        CausalLMConfig(
            vocab_size=config.vocab_size,
            d_model=config.d_model,
            num_heads=config.num_heads,
            num_layers=config.num_layers,
            d_ff=config.d_ff,
            context=config.eval_length,  # learned: rows L .. 4L - 1 are never trained
            dropout=0.0,
            positional=positional,
            norm="rms",
            activation="gelu",
            tie_output=False,
        )
    )


def train_model(model: CausalLM, config: PositionsConfig, generator: torch.Generator, device: torch.device) -> dict:
    """AdamW for ``config.steps`` steps on fresh batches of ``L`` tokens, loss averaged per predicted token.

    Returns:
        ``{"steps", "curve": [[step, training loss], ...], "seconds"}``.
    """
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    curve = []
    with Stopwatch() as watch:
        for step in range(1, config.steps + 1):
            ids, targets = (t.to(device) for t in make_batch(config, config.batch_size, config.train_length, generator))
            loss = model.loss(ids, targets) / (targets != IGNORE).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            if step % config.log_every == 0 or step == config.steps:
                curve.append([step, loss.item()])
    return {"steps": config.steps, "curve": curve, "seconds": watch.seconds}


@torch.no_grad()
def accuracy_by_position(model: CausalLM, ids: Tensor, targets: Tensor, batch_size: int = 64) -> list[float]:
    """The fraction of sequences whose greedy prediction at each position is the target.

    Returns:
        One accuracy per position ``k .. n - 1`` (the positions that have a target).
    """
    model.eval()
    correct = torch.zeros(ids.size(1), device=ids.device)
    for start in range(0, ids.size(0), batch_size):
        logits = model(ids[start : start + batch_size]).logits
        assert logits is not None  # project=True
        correct += (logits.argmax(-1) == targets[start : start + batch_size]).sum(0)
    model.train()
    has_target = (targets != IGNORE).any(0)
    return (correct[has_target] / ids.size(0)).tolist()


def summarise(per_position: list[float], config: PositionsConfig) -> dict:
    """The accuracy over position ranges of ``per_position`` (positions ``k ..``).

    Returns:
        ``{"trained": [k, L), "to_2x": [L, 2L), "to_4x": [2L, 4L), "beyond": [L, 4L),
        "length_1x" / "length_2x" / "length_4x": every position of a sequence of that length}``.
    """
    k, length = config.offset, config.train_length

    def mean(lo: int, hi: int) -> float:
        values = per_position[max(lo, k) - k : hi - k]
        return sum(values) / len(values)

    ranges = {"trained": (0, length), "to_2x": (length, 2 * length), "to_4x": (2 * length, 4 * length)}
    out = {name: mean(lo, hi) for name, (lo, hi) in ranges.items()}
    out["beyond"] = mean(length, 4 * length)
    out |= {f"length_{s}x": mean(0, s * length) for s in STRETCHES}
    return out


def run(
    *,
    out: str | Path,
    quick: bool = False,
    seed: int = 0,
    device: str | None = None,
    config: PositionsConfig | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Train one model per kind of position at length ``L``, test each on ``4 L`` tokens; write
    ``results.json`` and ``positions_extrapolation.png`` under ``<out>/positions-extrapolation``.

    Args:
        out: the folder the experiment's own folder is made in.
        quick: the small sizes of :data:`QUICK` (seconds; what the tests run).
        seed: seeds the models' initialisation and every batch.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ...
        config: sizes to run with instead (``quick`` is then ignored).
        progress: show a progress bar.

    Returns:
        The result, also written to ``results.json``.
    """
    config = config or (QUICK if quick else PositionsConfig())
    dev = pick_device(device)
    folder = experiment_dir(out, NAME)
    per_position: dict[str, list[float]] = {}
    training: dict[str, dict] = {}
    with Stopwatch() as watch, seeded(seed, dev):
        test_ids, test_targets = (
            t.to(dev)
            for t in make_batch(config, config.eval_size, config.eval_length, torch.Generator().manual_seed(seed + 1))
        )
        for kind in tqdm(KINDS, desc=NAME, unit="model", disable=not progress):
            torch.manual_seed(seed)  # the same initial weights wherever the kinds share them
            generator = torch.Generator().manual_seed(seed)  # ... and the same training batches
            model = build_model(config, kind)
            training[kind] = train_model(model, config, generator, dev)
            per_position[kind] = accuracy_by_position(model, test_ids, test_targets)
    results = {
        "kinds": list(KINDS),
        "train_length": config.train_length,
        "eval_length": config.eval_length,
        "offset": config.offset,
        "chance": 1.0 / config.vocab_size,
        "learned_table": f"{config.eval_length} rows, of which rows {config.train_length} and above are never trained",
        "accuracy": {kind: summarise(per_position[kind], config) for kind in KINDS},
        "accuracy_by_position": per_position,  # positions offset .. eval_length - 1
        "training": training,
    }
    results = rounded(results, 4)
    claims = claims_of(results)
    fig_name = "positions_extrapolation.png"
    _plot(results, config, folder / fig_name)
    result = ExperimentResult(
        name=NAME,
        quick=quick,
        seed=seed,
        config=asdict(config) | {"device": str(dev)},
        results=results,
        claims=claims,
        summary=_summary(results),
        figures=[fig_name],
        seconds=watch.seconds,
    )
    write_results(result, folder)
    return result


def claims_of(results: dict) -> dict[str, bool]:
    """Each claim of the experiment, checked against the accuracies in ``results``.

    Args:
        results: ``results["accuracy"][kind]`` as :func:`summarise` gives it.

    Returns:
        Claim -> whether the measurement supports it.
    """
    acc = results["accuracy"]
    return {
        "every kind of position learns the rule at the trained length": all(
            acc[kind]["trained"] >= SOLVED for kind in KINDS
        ),
        "learned positions lose the rule past the trained length": acc["learned"]["beyond"] < LOST,
        "sinusoidal positions lose the rule past the trained length": acc["sinusoidal"]["beyond"] < LOST,
        "rotary keeps the rule up to twice the trained length": acc["rotary"]["to_2x"] >= SOLVED,
        "rotary loses part of it between 2x and 4x": acc["rotary"]["to_4x"] < acc["rotary"]["to_2x"] - 0.1,
        "ALiBi keeps the rule up to 4x the trained length": acc["alibi"]["to_4x"] >= SOLVED,
    }


def _summary(results: dict) -> list[str]:
    length = results["train_length"]
    lines = [
        f"the answer at t is the token {results['offset']} back; trained on {length} tokens, tested on "
        f"{results['eval_length']}; chance {results['chance']:.3f}",
        f"{'positions':>10} | {'[k, L)':>7} {'[L, 2L)':>8} {'[2L, 4L)':>9} | whole sequence of {length}, "
        f"{2 * length}, {4 * length}",
    ]
    for kind in results["kinds"]:
        a = results["accuracy"][kind]
        lines.append(
            f"{kind:>10} | {a['trained']:>7.3f} {a['to_2x']:>8.3f} {a['to_4x']:>9.3f} | "
            f"{a['length_1x']:.3f} {a['length_2x']:.3f} {a['length_4x']:.3f}"
        )
    lines.append(f"learned table: {results['learned_table']}")
    return lines


COLORS = {"learned": "tab:red", "sinusoidal": "tab:orange", "rotary": "tab:blue", "alibi": "tab:green"}


def _plot(results: dict, config: PositionsConfig, path: Path) -> None:
    fig = new_figure(14, 4.4)
    ax_pos, ax_bar, ax_loss = fig.subplots(1, 3)
    k, length, w = results["offset"], results["train_length"], config.smooth
    for kind in results["kinds"]:
        acc = results["accuracy_by_position"][kind]  # positions k ..
        # blocks of w positions [i w, (i + 1) w), so that none straddles L or 2L (multiples of w when w divides L)
        blocks = [(max(lo, k), lo + w) for lo in range(0, k + len(acc), w)]
        blocks = [(lo, min(hi, k + len(acc))) for lo, hi in blocks if min(hi, k + len(acc)) > lo]
        xs = [(lo + hi - 1) / 2 for lo, hi in blocks]
        ys = [sum(acc[lo - k : hi - k]) / (hi - lo) for lo, hi in blocks]
        ax_pos.plot(xs, ys, color=COLORS[kind], label=kind)
    for x, label in ((length, "L (trained)"), (2 * length, "2L")):
        ax_pos.axvline(x, color="gray", ls="--", lw=0.8)
        ax_pos.text(x, 1.02, label, fontsize=8, ha="center")
    ax_pos.axhline(results["chance"], color="gray", ls=":", label="chance")
    ax_pos.set_ylim(0, 1.08)
    ax_pos.set_xlabel("position t")
    ax_pos.set_ylabel(f"accuracy at t (mean over {w} positions)")
    ax_pos.set_title(f"predict the token {k} back, trained on {length} tokens")
    ax_pos.legend(fontsize=8)

    ranges = (("trained", "[k, L)"), ("to_2x", "[L, 2L)"), ("to_4x", "[2L, 4L)"))
    width = 0.8 / len(results["kinds"])
    for j, kind in enumerate(results["kinds"]):
        values = [results["accuracy"][kind][key] for key, _ in ranges]
        ax_bar.bar([i + j * width for i in range(len(ranges))], values, width, color=COLORS[kind], label=kind)
    ax_bar.set_xticks([i + 0.4 - width / 2 for i in range(len(ranges))])
    ax_bar.set_xticklabels([label for _, label in ranges])
    ax_bar.axhline(results["chance"], color="gray", ls=":")
    ax_bar.set_ylim(0, 1.05)
    ax_bar.set_ylabel("accuracy over the positions")
    ax_bar.set_title("inside and beyond the trained length")
    ax_bar.legend(fontsize=8)

    for kind in results["kinds"]:
        curve = results["training"][kind]["curve"]
        ax_loss.plot([s for s, _ in curve], [v for _, v in curve], color=COLORS[kind], label=kind)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("training step")
    ax_loss.set_ylabel("training loss (nats per token)")
    ax_loss.set_title("training, at length L")
    ax_loss.legend(fontsize=8)
    save_figure(fig, path)


__all__ = ["QUICK", "PositionsConfig", "accuracy_by_position", "claims_of", "make_batch", "run", "summarise"]
