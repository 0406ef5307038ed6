"""Grouped-query attention: the key/value cache shrinks with the number of key/value heads; what
does the model lose?

In multi-head attention every one of the ``h`` heads has its own keys and values, and decoding keeps
them all for every token read so far: ``2 x layers x h x d_head`` numbers per token. Grouped-query
attention (Ainslie et al. 2023) lets groups of query heads share ``h_kv < h`` key/value heads
(``h_kv = 1``: multi-query attention, Shazeer 2019), which divides that cache by ``h / h_kv``. The
same character-level language model is trained on tiny Shakespeare with ``h_kv = h, h/2, ..., 1``,
the same steps and batches (paired by seed), and for each the cache is measured from the
tensors decoding keeps, against its validation loss.

Shape legend: ``b`` batch, ``s`` sequence, ``h`` query heads, ``h_kv`` key/value heads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from qkv.data.text import CharTokenizer, read_text_splits
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

NAME = "gqa-memory-quality"
QUALITY_TOLERANCE = 0.05  # nats per character: a loss within this of full attention's counts as the same


@dataclass(frozen=True)
class GQAConfig:
    """Sizes of the gqa-memory-quality experiment."""

    num_heads: int = 8  # h: query heads
    kv_heads: tuple[int, ...] = (8, 4, 2, 1)  # h_kv of each model; the first is full multi-head attention
    d_model: int = 128  # model width (d_head = d_model / h)
    num_layers: int = 2  # blocks
    d_ff: int = 256  # feed-forward width (SwiGLU: three matrices of d_model x d_ff)
    context: int = 64  # characters per training sequence
    batch_size: int = 32  # sequences per training step
    steps: int = 600  # AdamW steps per model and seed
    lr: float = 3e-3  # AdamW peak learning rate
    warmup: int = 50  # steps of linear warm-up; then the rate falls linearly to a tenth of the peak
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # gradient norm clipping
    log_every: int = 50  # training loss recorded every this many steps
    eval_batches: int = 16  # validation batches (of batch_size windows) per evaluation
    seeds: tuple[int, ...] = (0, 1)  # offsets added to the run's seed: every model is trained once per seed

    def __post_init__(self) -> None:
        if not self.kv_heads or self.kv_heads[0] != self.num_heads:
            raise ValueError(f"kv_heads must start with num_heads ({self.num_heads}), got {self.kv_heads}")
        if any(k < 1 or self.num_heads % k for k in self.kv_heads):
            raise ValueError(f"every kv_heads entry must divide num_heads ({self.num_heads}), got {self.kv_heads}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.steps < 1 or self.warmup < 1 or self.log_every < 1 or self.eval_batches < 1 or not self.seeds:
            raise ValueError(f"steps, log_every, eval_batches and seeds must be positive, got {self}")


QUICK = GQAConfig(
    num_heads=4,
    kv_heads=(4, 2, 1),
    d_model=32,
    d_ff=128,
    context=32,
    batch_size=16,
    steps=60,
    warmup=10,
    eval_batches=4,
    seeds=(0,),
)


def load_text(data_dir: str | Path | None) -> tuple[Tensor, Tensor, int, str]:
    """Tiny Shakespeare's training and validation splits as character ids (qkv's own split and lookup,
    :func:`qkv.data.text.read_text_splits`).

    Args:
        data_dir: the folder holding ``input.txt``; None: ``$QKV_DATA/tinyshakespeare`` or qkv's cache
            (downloaded there when missing).

    Returns:
        ``(train ids, validation ids, vocabulary size, where the text came from)``.
    """
    splits = read_text_splits({"source": "tinyshakespeare", "folder": None if data_dir is None else str(data_dir)})
    tokenizer = CharTokenizer(splits.train + splits.val)
    train = torch.tensor(tokenizer.encode(splits.train), dtype=torch.long)
    val = torch.tensor(tokenizer.encode(splits.val), dtype=torch.long)
    return train, val, tokenizer.vocab_size, splits.where


def windows(ids: Tensor, starts: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """The inputs ``(b, length)`` at ``starts (b,)`` and their next characters, the targets."""
    index = starts[:, None] + torch.arange(length + 1)  # (b, length + 1)
    chunk = ids[index]
    return chunk[:, :-1], chunk[:, 1:]


def build_model(config: GQAConfig, vocab_size: int, kv_heads: int) -> CausalLM:
    """A Llama-shaped causal LM (rotary, RMSNorm, SwiGLU, no biases, no dropout) with ``kv_heads``."""
    return CausalLM(
        CausalLMConfig(
            vocab_size=vocab_size,
            d_model=config.d_model,
            num_heads=config.num_heads,
            num_kv_heads=kv_heads,
            num_layers=config.num_layers,
            d_ff=config.d_ff,
            context=config.context,
            dropout=0.0,
            positional="rotary",
            norm="rms",
            activation="swiglu",
            bias=False,
        )
    )


@torch.no_grad()
def validation_loss(model: CausalLM, val: Tensor, starts: Tensor, config: GQAConfig) -> float:
    """The mean cross-entropy per character (nats) over the validation windows at ``starts``."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in starts.split(config.batch_size):
        ids, targets = (t.to(device) for t in windows(val, chunk, config.context))
        total += model.loss(ids, targets).item()
        count += targets.numel()
    model.train()
    return total / count


def cache_bytes_per_token(model: CausalLM, prompt: Tensor) -> dict:
    """The key/value cache decoding keeps after reading ``prompt (b, s)``, measured from its tensors.

    Returns:
        ``{"bytes_per_token", "shape": one layer's key (b, h_kv, s, d_head), "dtype"}``.
    """
    model.eval()
    with torch.no_grad():
        cache = model(prompt).cache
    model.train()
    assert cache is not None  # a causal LM returns its cache
    total = sum(c.key.nbytes + c.value.nbytes for c in cache)
    return {
        "bytes_per_token": total / prompt.numel(),
        "shape": list(cache[0].key.shape),
        "dtype": str(cache[0].key.dtype).removeprefix("torch."),
    }


def learning_rate_factor(config: GQAConfig, step: int) -> float:
    """The learning rate at ``step`` (0-based) as a fraction of the peak: a linear warm-up over
    ``config.warmup`` steps, then a linear fall to 0.1 at the last step (a steadier last iterate to
    compare than a constant rate gives)."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    remaining = (config.steps - step) / max(config.steps - config.warmup, 1)
    return 0.1 + 0.9 * max(remaining, 0.0)


def train_model(
    model: CausalLM, train: Tensor, config: GQAConfig, generator: torch.Generator, device: torch.device
) -> dict:
    """AdamW for ``config.steps`` steps on random windows of the training text, the rate as
    :func:`learning_rate_factor` says.

    Returns:
        ``{"steps", "curve": [[step, training loss], ...], "seconds"}``.
    """
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_factor(config, step))
    curve = []
    with Stopwatch() as watch:
        for step in range(1, config.steps + 1):
            starts = torch.randint(0, train.numel() - config.context - 1, (config.batch_size,), generator=generator)
            ids, targets = (t.to(device) for t in windows(train, starts, config.context))
            loss = model.loss(ids, targets) / targets.numel()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            schedule.step()
            if step % config.log_every == 0 or step == config.steps:
                curve.append([step, loss.item()])
    return {"steps": config.steps, "curve": curve, "seconds": watch.seconds}


def run(
    *,
    out: str | Path,
    quick: bool = False,
    seed: int = 0,
    device: str | None = None,
    config: GQAConfig | None = None,
    data_dir: str | Path | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Train the model with each number of key/value heads (once per seed); measure its cache and its
    validation loss; write ``results.json`` and ``gqa_memory_quality.png`` under ``<out>/gqa-memory-quality``.

    Args:
        out: the folder the experiment's own folder is made in.
        quick: the small sizes of :data:`QUICK` (seconds; what the tests run).
        seed: seeds the models' initialisation and every batch.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ...
        config: sizes to run with instead (``quick`` is then ignored).
        data_dir: the folder holding tiny Shakespeare's ``input.txt``; None: qkv's lookup.
        progress: show a progress bar.

    Returns:
        The result, also written to ``results.json``.
    """
    config = config or (QUICK if quick else GQAConfig())
    dev = pick_device(device)
    folder = experiment_dir(out, NAME)
    train, val, vocab_size, where = load_text(data_dir)
    val_starts = torch.randint(
        0,
        val.numel() - config.context - 1,
        (config.eval_batches * config.batch_size,),
        generator=torch.Generator().manual_seed(seed + 1),
    )
    models: dict[str, dict] = {}
    jobs = [(kv, s) for kv in config.kv_heads for s in config.seeds]
    with Stopwatch() as watch, seeded(seed, dev):
        for kv, offset in tqdm(jobs, desc=NAME, unit="model", disable=not progress):
            torch.manual_seed(seed + offset)
            generator = torch.Generator().manual_seed(seed + offset)  # the same batches for every h_kv
            model = build_model(config, vocab_size, kv).to(dev)
            info = train_model(model, train, config, generator, dev)
            entry = models.setdefault(
                str(kv),
                {
                    "kv_heads": kv,
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "cache": cache_bytes_per_token(model, val[None, : config.context].to(dev)),
                    "expected_bytes_per_token": expected_bytes_per_token(config, kv),
                    "val_loss_by_seed": [],
                    "training": [],
                },
            )
            entry["val_loss_by_seed"].append(validation_loss(model, val, val_starts, config))
            entry["training"].append(info)
    full = models[str(config.num_heads)]
    for entry in models.values():
        losses = entry["val_loss_by_seed"]
        entry["val_loss"] = sum(losses) / len(losses)
        entry["val_loss_spread"] = max(losses) - min(losses)
        entry["cache_ratio"] = entry["cache"]["bytes_per_token"] / full["cache"]["bytes_per_token"]
        entry["loss_over_full"] = entry["val_loss"] - full["val_loss"]
        # paired by seed: the same batches as full attention's run of that seed
        entry["loss_over_full_by_seed"] = [a - b for a, b in zip(losses, full["val_loss_by_seed"])]
    results = rounded(
        {
            "num_heads": config.num_heads,
            "head_dim": config.d_model // config.num_heads,
            "num_layers": config.num_layers,
            "kv_heads": list(config.kv_heads),
            "context": config.context,
            "vocab_size": vocab_size,
            "data": where,
            "quality_tolerance": QUALITY_TOLERANCE,
            "models": models,
        },
        6,
    )
    claims = claims_of(results)
    fig_name = "gqa_memory_quality.png"
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


def expected_bytes_per_token(config: GQAConfig, kv_heads: int) -> int:
    """``2 (keys and values) x layers x h_kv x d_head x 4 bytes`` (float32)."""
    return 2 * config.num_layers * kv_heads * (config.d_model // config.num_heads) * 4


def claims_of(results: dict) -> dict[str, bool]:
    """Each claim of the experiment, checked against the measurements in ``results``.

    Args:
        results: ``results["models"][str(h_kv)]`` with its measured cache and validation loss.

    Returns:
        Claim -> whether the measurement supports it.
    """
    h = results["num_heads"]
    models = results["models"]
    fewest = models[str(min(results["kv_heads"]))]
    grouped = [m for m in models.values() if 1 < m["kv_heads"] < h]
    return {
        "the cache holds 2 x layers x h_kv x d_head numbers per token": all(
            m["cache"]["bytes_per_token"] == m["expected_bytes_per_token"] for m in models.values()
        ),
        "the cache shrinks by h / h_kv": all(
            math.isclose(m["cache_ratio"], m["kv_heads"] / h, rel_tol=1e-9) for m in models.values()
        ),
        f"grouped-query heads (1 < h_kv < h) lose under {QUALITY_TOLERANCE} nats per character": bool(grouped)
        and all(m["loss_over_full"] < QUALITY_TOLERANCE for m in grouped),
        "fewer key/value heads cost some loss: above full attention at every seed": all(
            d > 0 for m in models.values() if m["kv_heads"] < h for d in m["loss_over_full_by_seed"]
        ),
        f"multi-query attention loses under {QUALITY_TOLERANCE} nats per character": fewest["loss_over_full"]
        < QUALITY_TOLERANCE,
    }


def _summary(results: dict) -> list[str]:
    lines = [
        f"{results['data'].split(' (')[0]}: characters, {results['num_layers']} layers, h = {results['num_heads']} "
        f"query heads of {results['head_dim']}, context {results['context']}",
        f"{'h_kv':>5} {'parameters':>10} {'cache B/token':>13} {'x full':>7} {'val loss':>9} {'- full':>8} "
        f"{'seed spread':>11}  - full at each seed",
    ]
    for m in results["models"].values():
        paired = " ".join(f"{d:+.4f}" for d in m["loss_over_full_by_seed"])
        lines.append(
            f"{m['kv_heads']:>5} {m['parameters']:>10,} {m['cache']['bytes_per_token']:>13,.0f} "
            f"{m['cache_ratio']:>7.3f} {m['val_loss']:>9.4f} {m['loss_over_full']:>+8.4f} "
            f"{m['val_loss_spread']:>11.4f}  {paired}"
        )
    return lines


def _plot(results: dict, path: Path) -> None:
    fig = new_figure(15, 4.4)
    ax_trade, ax_paired, ax_curve = fig.subplots(1, 3)
    models = list(results["models"].values())
    cache = [m["cache"]["bytes_per_token"] for m in models]
    loss = [m["val_loss"] for m in models]
    ax_trade.plot(cache, loss, "o-", color="tab:blue", label="mean over seeds")
    for i, (m, x, y) in enumerate(zip(models, cache, loss)):
        seeds = m["val_loss_by_seed"]
        ax_trade.plot([x] * len(seeds), seeds, ".", color="tab:gray", label="one seed" if i == 0 else None)
        ax_trade.annotate(f"h_kv = {m['kv_heads']}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax_trade.set_xscale("log", base=2)
    ax_trade.set_xticks(cache, [f"{c:,.0f}" for c in cache])
    ax_trade.minorticks_off()
    ax_trade.margins(x=0.15)
    ax_trade.set_xlabel("KV cache per token (bytes, measured)")
    ax_trade.set_ylabel("validation loss (nats per character)")
    ax_trade.set_title(f"memory against quality (h = {results['num_heads']} query heads)")
    ax_trade.legend(fontsize=8)

    fewer = [m for m in models if m["kv_heads"] < results["num_heads"]]
    num_seeds = len(fewer[0]["loss_over_full_by_seed"]) if fewer else 0
    width = 0.8 / max(num_seeds, 1)
    for j in range(num_seeds):
        ax_paired.bar(
            [i + j * width for i in range(len(fewer))],
            [m["loss_over_full_by_seed"][j] for m in fewer],
            width,
            label=f"seed {j}",
        )
    ax_paired.set_xticks([i + 0.4 - width / 2 for i in range(len(fewer))])
    ax_paired.set_xticklabels([f"h_kv = {m['kv_heads']}" for m in fewer])
    ax_paired.axhline(0.0, color="black", lw=0.8)
    ax_paired.axhline(results["quality_tolerance"], color="gray", ls=":", label="tolerance")
    ax_paired.set_ylabel("validation loss - full attention's (nats)")
    ax_paired.set_title("the cost, paired by seed (same batches)")
    ax_paired.legend(fontsize=8)

    colors = ["black", "tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple"]
    for m, color in zip(models, colors):
        curve = m["training"][0]["curve"]
        ax_curve.plot([s for s, _ in curve], [v for _, v in curve], color=color, label=f"h_kv = {m['kv_heads']}")
    ax_curve.set_xlabel("training step")
    ax_curve.set_ylabel("training loss (nats per character)")
    ax_curve.set_title("training (first seed)")
    ax_curve.legend(fontsize=8)
    save_figure(fig, path)


__all__ = [
    "QUICK",
    "GQAConfig",
    "build_model",
    "cache_bytes_per_token",
    "claims_of",
    "expected_bytes_per_token",
    "load_text",
    "run",
    "validation_loss",
]
