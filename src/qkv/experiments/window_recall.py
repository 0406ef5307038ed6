"""Sliding-window attention against full attention on long-range recall: what a window cannot see,
and how stacking windows, or keeping one full layer, gives the reach back.

The task: one of ``K`` symbols appears once in a stream of noise tokens, ``D`` tokens before a final
query token; the answer at the query is that symbol. With a sliding window of ``W`` a query sees
itself and the ``W - 1`` tokens before it, so one windowed layer cannot reach a symbol ``D >= W``
back. Each further windowed layer reaches ``W - 1`` tokens further, through the tokens in between:
``n`` layers reach ``n (W - 1)`` back at most. A full-attention layer anywhere in the stack reaches
the whole sequence.

The reach is measured twice for every model: from the gradients (the farthest input position whose
embedding changes the last hidden state at all: exactly zero beyond the windows' reach) and from the
recall accuracy at each distance after training.

Shape legend: ``b`` batch, ``T`` sequence length, ``D`` distance from the symbol to the query.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
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
from qkv.models.causal_lm import CausalLM, CausalLMConfig

NAME = "window-recall"
SOLVED = 0.9  # accuracy at which a distance counts as recalled
CHANCE_MARGIN = 0.15  # accuracy within this of chance counts as not recalled


@dataclass(frozen=True)
class Variant:
    """One model of the experiment: its depth and the layers that have the sliding window."""

    name: str
    num_layers: int
    window_layers: tuple[int, ...] | None  # None: every layer has the window; () : none has it

    def windows(self) -> list[int]:
        """The layers with the window."""
        return list(range(self.num_layers)) if self.window_layers is None else list(self.window_layers)


VARIANTS = (
    Variant("full attention", 2, ()),
    Variant("window x1", 1, None),
    Variant("window x2", 2, None),
    Variant("window x4", 4, None),
    Variant("window, then full", 2, (0,)),
    Variant("full, then window", 2, (1,)),
)


@dataclass(frozen=True)
class WindowRecallConfig:
    """Sizes of the window-recall experiment."""

    window: int = 8  # W: a query sees itself and the W - 1 tokens before it
    max_distance: int = 32  # D from 1 to this; beyond 4 (W - 1) so that no stack here reaches them all
    lead: int = 4  # noise tokens always before the farthest symbol
    num_symbols: int = 8  # K: answers (chance is 1/K)
    num_noise: int = 8  # distinct noise tokens
    d_model: int = 64  # model width
    num_heads: int = 4  # attention heads
    d_ff: int = 128  # feed-forward width
    batch_size: int = 64  # sequences per training step
    steps: int = 800  # Adam steps per model
    lr: float = 3e-3  # AdamW learning rate, no weight decay
    grad_clip: float = 1.0  # gradient norm clipping
    log_every: int = 50  # training loss recorded every this many steps
    eval_per_distance: int = 128  # test sequences at each distance
    variants: tuple[Variant, ...] = VARIANTS

    def __post_init__(self) -> None:
        if self.window < 2 or self.max_distance < self.window:
            raise ValueError(f"need window >= 2 and max_distance >= window, got {self.window}, {self.max_distance}")
        if self.num_symbols < 2 or self.num_noise < 1 or self.lead < 0:
            raise ValueError(f"need num_symbols >= 2, num_noise >= 1, lead >= 0, got {self}")
        if self.steps < 1 or self.log_every < 1 or self.eval_per_distance < 1 or not self.variants:
            raise ValueError(f"steps, log_every, eval_per_distance and variants must be positive, got {self}")

    @property
    def length(self) -> int:
        """T: every sequence's length (the lead, the farthest symbol, the noise, the query)."""
        return self.lead + self.max_distance + 1

    @property
    def vocab_size(self) -> int:
        """Symbols, noise tokens and the query token."""
        return self.num_symbols + self.num_noise + 1

    @property
    def query_id(self) -> int:
        """The id of the query token (after the symbols and the noise)."""
        return self.num_symbols + self.num_noise


QUICK = WindowRecallConfig(
    window=4,
    max_distance=12,
    d_model=32,
    d_ff=64,
    batch_size=32,
    steps=150,
    eval_per_distance=32,
    variants=(
        Variant("full attention", 2, ()),
        Variant("window x1", 1, None),
        Variant("window x2", 2, None),
        Variant("window, then full", 2, (0,)),
    ),
)


def make_batch(config: WindowRecallConfig, distances: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """One sequence per entry of ``distances (b,)``: noise, a symbol ``D`` tokens before the end,
    noise, the query token.

    Returns:
        ``ids (b, T)`` int64 and ``answers (b,)``, the symbols.
    """
    size, k = distances.numel(), config.num_symbols
    ids = torch.randint(k, k + config.num_noise, (size, config.length), generator=generator)
    answers = torch.randint(0, k, (size,), generator=generator)
    ids[torch.arange(size), config.length - 1 - distances] = answers
    ids[:, -1] = config.query_id
    return ids, answers


def build_model(config: WindowRecallConfig, variant: Variant) -> CausalLM:
    """A pre-LN causal LM with rotary positions (RMSNorm, GELU, no dropout) shaped as ``variant``."""
    windows = variant.windows()
    return CausalLM(
        CausalLMConfig(
            vocab_size=config.vocab_size,
            d_model=config.d_model,
            num_heads=config.num_heads,
            num_layers=variant.num_layers,
            d_ff=config.d_ff,
            context=config.length,
            dropout=0.0,
            positional="rotary",
            norm="rms",
            activation="gelu",
            tie_output=False,
            sliding_window=config.window if windows else None,
            sliding_window_layers=windows if windows else None,
        )
    )


def answer_logits(model: CausalLM, ids: Tensor) -> Tensor:
    """The logits at the query (the last position), ``(b, V)``."""
    hidden = model(ids, project=False).hidden[:, -1]  # (b, d)
    return model.logits(hidden)


def train_model(model: CausalLM, config: WindowRecallConfig, generator: torch.Generator, device: torch.device) -> dict:
    """AdamW for ``config.steps`` steps on fresh batches, each sequence at a distance drawn from
    ``1 .. max_distance``; the loss is the cross-entropy of the answer at the query.

    Returns:
        ``{"steps", "curve": [[step, training loss], ...], "seconds"}``.
    """
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    curve = []
    with Stopwatch() as watch:
        for step in range(1, config.steps + 1):
            distances = torch.randint(1, config.max_distance + 1, (config.batch_size,), generator=generator)
            ids, answers = (t.to(device) for t in make_batch(config, distances, generator))
            loss = F.cross_entropy(answer_logits(model, ids), answers)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            if step % config.log_every == 0 or step == config.steps:
                curve.append([step, loss.item()])
    return {"steps": config.steps, "curve": curve, "seconds": watch.seconds}


@torch.no_grad()
def accuracy_by_distance(model: CausalLM, config: WindowRecallConfig, generator: torch.Generator) -> list[float]:
    """The recall accuracy on fresh sequences at each distance ``1 .. max_distance``.

    Returns:
        ``acc[D - 1]`` for distance ``D``.
    """
    model.eval()
    device = next(model.parameters()).device
    out = []
    for distance in range(1, config.max_distance + 1):
        distances = torch.full((config.eval_per_distance,), distance)
        ids, answers = (t.to(device) for t in make_batch(config, distances, generator))
        out.append((answer_logits(model, ids).argmax(-1) == answers).float().mean().item())
    model.train()
    return out


def gradient_reach(model: CausalLM, ids: Tensor) -> int:
    """How far back the last position's final hidden state depends on the input: the largest ``D``
    such that the gradient of ``hidden[:, -1]`` with respect to the embedding at ``T - 1 - D`` is not
    exactly zero (a masked key's softmax weight is exactly zero, so is its gradient).

    Args:
        model: a causal LM whose positions are applied in the attention (no table added to the input).
        ids: ``(b, T)``.

    Returns:
        The reach ``D`` (``T - 1`` when the whole sequence is reached).
    """
    model.eval()
    x = model.token_embedding(ids).detach().requires_grad_(True)  # (b, T, d)
    hidden, _, _ = model.decoder(x)
    direction = torch.randn(hidden.size(-1), generator=torch.Generator().manual_seed(0)).to(hidden)
    (grad,) = torch.autograd.grad((hidden[:, -1] @ direction).sum(), x)
    model.train()
    reached = grad.abs().amax(dim=(0, 2)) > 0  # (T,)
    first = int(reached.nonzero().min())
    return ids.size(1) - 1 - first


def run(
    *,
    out: str | Path,
    quick: bool = False,
    seed: int = 0,
    device: str | None = None,
    config: WindowRecallConfig | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Train every variant on the recall task, measure its reach from the gradients and its accuracy
    at every distance; write ``results.json`` and ``window_recall.png`` under ``<out>/window-recall``.

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
    config = config or (QUICK if quick else WindowRecallConfig())
    dev = pick_device(device)
    folder = experiment_dir(out, NAME)
    models: dict[str, dict] = {}
    with Stopwatch() as watch, seeded(seed, dev):
        probe, _ = make_batch(config, torch.ones(4, dtype=torch.long), torch.Generator().manual_seed(seed + 2))
        for variant in tqdm(config.variants, desc=NAME, unit="model", disable=not progress):
            torch.manual_seed(seed)
            generator = torch.Generator().manual_seed(seed)  # the same training batches for every variant
            model = build_model(config, variant).to(dev)
            reach_at_init = gradient_reach(model, probe.to(dev))
            info = train_model(model, config, generator, dev)
            accuracy = accuracy_by_distance(model, config, torch.Generator().manual_seed(seed + 1))
            models[variant.name] = {
                "num_layers": variant.num_layers,
                "window_layers": variant.windows(),
                "reach_expected": expected_reach(config, variant),
                "reach_gradient": gradient_reach(model, probe.to(dev)),
                "reach_gradient_at_init": reach_at_init,
                "reach_recalled": recalled_reach(accuracy),
                "accuracy": accuracy,
                "training": info,
            }
    results = rounded(
        {
            "window": config.window,
            "distances": list(range(1, config.max_distance + 1)),
            "length": config.length,
            "chance": 1.0 / config.num_symbols,
            "models": models,
        },
        4,
    )
    claims = claims_of(results)
    fig_name = "window_recall.png"
    _plot(results, folder / fig_name)
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


def expected_reach(config: WindowRecallConfig, variant: Variant) -> int:
    """The farthest distance the variant can reach: ``n (W - 1)`` for ``n`` windowed layers, the whole
    sequence (``T - 1``) with any full layer."""
    if len(variant.windows()) < variant.num_layers:
        return config.length - 1
    return variant.num_layers * (config.window - 1)


def recalled_reach(accuracy: list[float]) -> int:
    """The largest ``D`` such that every distance ``1 .. D`` is recalled (accuracy >= SOLVED); 0 if none."""
    reach = 0
    for distance, value in enumerate(accuracy, start=1):
        if value < SOLVED:
            break
        reach = distance
    return reach


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def claims_of(results: dict) -> dict[str, bool]:
    """Each claim of the experiment, checked against the measurements in ``results``.

    Args:
        results: ``results["models"][name]`` with its ``accuracy`` by distance and its reaches.

    Returns:
        Claim -> whether the measurement supports it.
    """
    models, w, chance = results["models"], results["window"], results["chance"]
    longest = len(results["distances"])
    stacks = {name: m for name, m in models.items() if len(m["window_layers"]) == m["num_layers"]}
    mixed = {name: m for name, m in models.items() if 0 < len(m["window_layers"]) < m["num_layers"]}
    one = [m for m in stacks.values() if m["num_layers"] == 1]
    deeper = [m for m in stacks.values() if m["num_layers"] > 1]
    claims = {
        "full attention recalls at every distance": all(
            min(m["accuracy"]) >= SOLVED for m in models.values() if not m["window_layers"]
        ),
        "one windowed layer recalls inside its window and not beyond": bool(one)
        and all(
            min(m["accuracy"][: w - 1]) >= SOLVED and _mean(m["accuracy"][w - 1 :]) < chance + CHANCE_MARGIN
            for m in one
        ),
        "the gradients reach n (W - 1) tokens back through n windowed layers": all(
            m["reach_gradient"] == m["reach_expected"] for m in stacks.values()
        ),
        "stacked windows recall beyond one window": bool(deeper) and all(m["reach_recalled"] >= w for m in deeper),
        "no windowed stack recalls beyond its reach": all(
            _mean(m["accuracy"][m["reach_expected"] :]) < chance + CHANCE_MARGIN
            for m in stacks.values()
            if m["reach_expected"] < longest
        ),
        "one full layer among windowed ones recalls at every distance": bool(mixed)
        and all(min(m["accuracy"]) >= SOLVED for m in mixed.values()),
    }
    return claims


def _summary(results: dict) -> list[str]:
    w, longest = results["window"], len(results["distances"])
    lines = [
        f"recall a symbol D = 1..{longest} tokens back; window W = {w} (a query sees itself and {w - 1} before it); "
        f"chance {results['chance']:.3f}",
        f"{'model':>18} | reach: {'n(W-1)':>6} {'gradient':>8} {'recalled':>8} | accuracy D<W, W<=D<=2(W-1), D>2(W-1)",
    ]
    for name, m in results["models"].items():
        acc = m["accuracy"]
        lines.append(
            f"{name:>18} | {m['reach_expected']:>13} {m['reach_gradient']:>8} {m['reach_recalled']:>8} | "
            f"{_mean(acc[: w - 1]):.3f} {_mean(acc[w - 1 : 2 * (w - 1)]):.3f} {_mean(acc[2 * (w - 1) :]):.3f}"
        )
    return lines


def _plot(results: dict, path: Path) -> None:
    fig = new_figure(13, 4.6)
    ax_acc, ax_reach = fig.subplots(1, 2, width_ratios=[3, 2])
    distances, w = results["distances"], results["window"]
    colors = ["black", "tab:red", "tab:orange", "tab:purple", "tab:blue", "tab:green", "tab:brown", "tab:gray"]
    for (name, m), color in zip(results["models"].items(), colors):
        ls = "-" if len(m["window_layers"]) in (0, m["num_layers"]) else "--"
        ax_acc.plot(distances, m["accuracy"], ls, color=color, marker=".", label=name)
    for n in range(1, 1 + max(m["num_layers"] for m in results["models"].values())):
        if n * (w - 1) < distances[-1]:
            ax_acc.axvline(n * (w - 1) + 0.5, color="gray", ls=":", lw=0.8)
            ax_acc.text(n * (w - 1) + 0.5, 1.02, f"{n}(W-1)", fontsize=8, ha="center")
    ax_acc.axhline(results["chance"], color="gray", ls=":", label="chance")
    ax_acc.set_ylim(0, 1.08)
    ax_acc.set_xlabel("D: tokens between the symbol and the query")
    ax_acc.set_ylabel("recall accuracy")
    ax_acc.set_title(f"recall with a sliding window of W = {w}")
    ax_acc.legend(fontsize=8)

    names = list(results["models"])
    ys = range(len(names))
    ax_reach.barh([y + 0.2 for y in ys], [results["models"][n]["reach_gradient"] for n in names], 0.4, label="gradient")
    ax_reach.barh([y - 0.2 for y in ys], [results["models"][n]["reach_recalled"] for n in names], 0.4, label="recalled")
    ax_reach.axvline(distances[-1], color="gray", ls=":", lw=0.8, label="farthest D tested")
    ax_reach.set_yticks(list(ys))
    ax_reach.set_yticklabels(names, fontsize=8)
    ax_reach.invert_yaxis()
    ax_reach.set_xlabel("reach (tokens back)")
    ax_reach.set_title("how far back each model reaches")
    ax_reach.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    save_figure(fig, path)


__all__ = [
    "QUICK",
    "VARIANTS",
    "Variant",
    "WindowRecallConfig",
    "accuracy_by_distance",
    "claims_of",
    "expected_reach",
    "gradient_reach",
    "make_batch",
    "recalled_reach",
    "run",
]
