"""Images as sequences of patch tokens: a small Vision Transformer (Dosovitskiy et al., 2021) on
the 8x8 handwritten digits that scikit-learn ships (1,797 images, no download).

Each image is cut into ``patch x patch`` squares; each square's pixels are flattened and linearly
embedded into one token; a learned class token is prepended and learned position embeddings are
added; qkv :class:`EncoderLayer` blocks (pre-LN, GELU) attend over the tokens; the class token's
final state is classified. The class token's attention over the patches shows where the model
looks. Two maps are drawn: the last layer's weights (mean over heads) and the attention rollout
of Abnar & Zuidema (2020), which multiplies the layers' (head-averaged, residual-augmented)
weight matrices to follow attention through the whole stack.

Shape legend: ``b`` batch, ``P`` patches, ``t = P + 1`` tokens, ``d`` d_model, ``h`` heads,
``g = 8 / patch`` patches per side.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
from qkv.nn.layers import EncoderLayer

logger = logging.getLogger(__name__)

NAME = "vit-digits"
IMAGE_SIZE = 8


@dataclass(frozen=True)
class ViTDigitsConfig:
    """Sizes and training schedule of the digits Vision Transformer."""

    patch_size: int = 2  # pixels per patch side: 8x8 images -> (8 / patch)^2 tokens
    d_model: int = 64  # token width
    num_heads: int = 4  # attention heads
    num_layers: int = 2  # encoder layers
    d_ff: int = 128  # feed-forward width
    dropout: float = 0.1  # residual dropout
    epochs: int = 80  # passes over the training images
    batch_size: int = 64  # images per step
    lr: float = 5e-3  # peak learning rate (one-cycle schedule, AdamW)
    weight_decay: float = 0.05  # AdamW weight decay
    label_smoothing: float = 0.1  # cross-entropy label smoothing
    max_shift: int = 1  # augmentation: random translation by up to this many pixels
    test_fraction: float = 0.2  # held-out share of the images (stratified)
    num_examples: int = 8  # test images drawn with their attention maps

    def __post_init__(self) -> None:
        if self.patch_size < 1 or IMAGE_SIZE % self.patch_size:
            raise ValueError(f"patch_size must divide {IMAGE_SIZE}, got {self.patch_size}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be positive, got {self.epochs}")

    @property
    def num_patches(self) -> int:
        """The number of patches an image is cut into."""
        return (IMAGE_SIZE // self.patch_size) ** 2


QUICK = ViTDigitsConfig(epochs=20)


def load_digits_split(config: ViTDigitsConfig, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's digits as ``(b, 8, 8)`` floats in [0, 1], split stratified by class.

    Returns:
        ``train_images, train_labels, test_images, test_labels``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = torch.tensor(images, dtype=torch.float32).view(-1, IMAGE_SIZE, IMAGE_SIZE) / 16.0  # (b, 8, 8)
    labels = torch.tensor(labels, dtype=torch.long)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=config.test_fraction, stratify=labels, random_state=seed
    )
    return train_x, train_y, test_x, test_y


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """Cut ``(b, H, W)`` images into flattened patches, row by row.

    Returns:
        ``(b, (H / p) * (W / p), p * p)``.
    """
    b, height, width = images.shape
    g_h, g_w = height // patch_size, width // patch_size
    patches = images.view(b, g_h, patch_size, g_w, patch_size)  # (b, g_h, p, g_w, p)
    return patches.permute(0, 1, 3, 2, 4).reshape(b, g_h * g_w, patch_size * patch_size)  # (b, P, p*p)


def random_shift(images: Tensor, max_shift: int, generator: torch.Generator) -> Tensor:
    """Translate each image by up to ``max_shift`` pixels in each direction, filling with zeros."""
    if max_shift == 0:
        return images
    b, height, width = images.shape
    padded = F.pad(images, (max_shift,) * 4)  # (b, H + 2m, W + 2m)
    dy = torch.randint(0, 2 * max_shift + 1, (b,), generator=generator).to(images.device)
    dx = torch.randint(0, 2 * max_shift + 1, (b,), generator=generator).to(images.device)
    rows = dy[:, None] + torch.arange(height, device=images.device)  # (b, H)
    cols = dx[:, None] + torch.arange(width, device=images.device)  # (b, W)
    batch = torch.arange(b, device=images.device)[:, None, None]
    return padded[batch, rows[:, :, None], cols[:, None, :]]  # (b, H, W)


class VisionTransformer(nn.Module):
    """Patch embedding, class token, learned positions, pre-LN encoder layers, a linear head."""

    def __init__(self, *, config: ViTDigitsConfig, num_classes: int = 10) -> None:
        super().__init__()
        d = config.d_model
        self.patch_size = config.patch_size
        self.patch_embed = nn.Linear(config.patch_size**2, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.position = nn.Parameter(torch.randn(1, config.num_patches + 1, d) * 0.02)
        self.layers = nn.ModuleList(
            EncoderLayer(
                d_model=d,
                num_heads=config.num_heads,
                d_ff=config.d_ff,
                dropout=config.dropout,
                activation="gelu",
                norm_first=True,
            )
            for _ in range(config.num_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, num_classes)

    def forward(self, images: Tensor, *, need_weights: bool = False) -> tuple[Tensor, list[Tensor] | None]:
        """Args: ``images (b, 8, 8)``. Returns logits ``(b, classes)`` and, if asked, the weights of
        every layer ``(b, h, t, t)`` (token 0 is the class token)."""
        tokens = self.patch_embed(patchify(images, self.patch_size))  # (b, P, d)
        cls = self.cls_token.expand(tokens.size(0), -1, -1)  # (b, 1, d)
        x = torch.cat([cls, tokens], dim=1) + self.position  # (b, t, d)
        weights: list[Tensor] | None = [] if need_weights else None
        for layer in self.layers:
            out = layer(x, need_weights=need_weights)
            x = out.output
            if weights is not None:
                weights.append(out.self_weights)
        return self.head(self.norm(x[:, 0])), weights


def attention_rollout(weights: list[Tensor]) -> Tensor:
    """Attention rollout (Abnar & Zuidema, 2020): average heads, add the residual identity,
    renormalise rows, multiply through the layers.

    Args:
        weights: per layer ``(b, h, t, t)``.

    Returns:
        ``(b, t, t)``: how much each output token draws on each input token.
    """
    if not weights:
        raise ValueError("attention rollout needs the weights of at least one layer, got none")
    rollout: Tensor | None = None
    for layer_weights in weights:
        a = layer_weights.mean(1)  # (b, t, t)
        a = a + torch.eye(a.size(-1), device=a.device, dtype=a.dtype)
        a = a / a.sum(-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout
    assert rollout is not None  # weights is not empty
    return rollout


@torch.no_grad()
def evaluate(model: VisionTransformer, images: Tensor, labels: Tensor) -> float:
    """The accuracy of ``model`` on ``images`` and their ``labels``."""
    model.eval()
    logits, _ = model(images)
    return (logits.argmax(-1) == labels).float().mean().item()


def train(
    model: VisionTransformer,
    config: ViTDigitsConfig,
    train_x: Tensor,
    train_y: Tensor,
    generator: torch.Generator,
    *,
    progress: bool = True,
) -> list[float]:
    """AdamW with a one-cycle schedule, label smoothing and random shifts. Returns the loss per epoch."""
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        weight_decay=config.weight_decay,
        fused=next(model.parameters()).device.type in ("cpu", "cuda"),
    )
    steps_per_epoch = math.ceil(train_x.size(0) / config.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.lr, total_steps=config.epochs * steps_per_epoch, pct_start=0.1
    )
    losses = []
    for _ in tqdm(range(config.epochs), desc=NAME, unit="epoch", disable=not progress):
        model.train()
        order = torch.randperm(train_x.size(0), generator=generator).to(train_x.device)
        total = 0.0
        for start in range(0, train_x.size(0), config.batch_size):
            index = order[start : start + config.batch_size]
            images = random_shift(train_x[index], config.max_shift, generator)
            logits, _ = model(images)
            loss = F.cross_entropy(logits, train_y[index], label_smoothing=config.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item() * index.numel()
        losses.append(total / train_x.size(0))
    return losses


def run(
    *,
    out: str | Path,
    quick: bool = False,
    seed: int = 0,
    device: str | None = None,
    config: ViTDigitsConfig | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Train the digits ViT, test it, draw the class token's attention; write ``results.json`` and
    ``vit_digits.png`` under ``<out>/vit-digits``."""
    config = config or (QUICK if quick else ViTDigitsConfig())
    dev = pick_device(device)
    folder = experiment_dir(out, NAME)
    with Stopwatch() as watch, seeded(seed, dev):
        generator = torch.Generator().manual_seed(seed)
        train_x, train_y, test_x, test_y = (t.to(dev) for t in load_digits_split(config, seed))
        model = VisionTransformer(config=config).to(dev)
        cpu_start = time.process_time()
        with Stopwatch() as training:
            losses = train(model, config, train_x, train_y, generator, progress=progress)
        train_cpu_seconds = time.process_time() - cpu_start  # this process's CPU time, all threads
        test_accuracy = evaluate(model, test_x, test_y)
        train_accuracy = evaluate(model, train_x, train_y)
        with torch.no_grad():
            logits, weights = model(test_x, need_weights=True)
        predictions = logits.argmax(-1)
        rollout = attention_rollout(weights)  # (b, t, t)
        last_cls = weights[-1].mean(1)[:, 0, 1:]  # (b, P): class token -> patches, last layer
        rollout_cls = rollout[:, 0, 1:]  # (b, P)
    picks = list(range(min(config.num_examples, test_x.size(0))))
    results: dict[str, Any] = {
        "test_accuracy": test_accuracy,
        "train_accuracy": train_accuracy,
        "train_seconds": training.seconds,
        "train_cpu_seconds": train_cpu_seconds,
        "test_images": int(test_x.size(0)),
        "train_images": int(train_x.size(0)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens": config.num_patches + 1,
        "loss_per_epoch": losses,
        "cls_attention_last_layer_mean_over_test": last_cls.mean(0).tolist(),
        "cls_attention_row_sums": [
            float(weights[-1][:, :, 0].sum(-1).min()),
            float(weights[-1][:, :, 0].sum(-1).max()),
        ],
        "examples": [
            {
                "label": int(test_y[i]),
                "prediction": int(predictions[i]),
                "cls_attention_last_layer": last_cls[i].tolist(),
                "cls_attention_rollout": rollout_cls[i].tolist(),
            }
            for i in picks
        ],
        "threads": torch.get_num_threads(),
    }
    claims = {
        "at least 95% test accuracy": test_accuracy >= 0.95,
        "trained within 2 minutes": training.seconds <= 120.0,
    }
    summary = _summary(results, config, dev)
    fig_name = "vit_digits.png"
    _plot(test_x[picks].cpu(), results, config, folder / fig_name)
    result = ExperimentResult(
        name=NAME,
        quick=quick,
        seed=seed,
        config=asdict(config) | {"device": str(dev)},
        results=rounded(results, 6),
        claims=claims,
        summary=summary,
        figures=[fig_name],
        seconds=watch.seconds,
    )
    write_results(result, folder)
    return result


def _summary(results: dict[str, Any], config: ViTDigitsConfig, device: torch.device) -> list[str]:
    """Two lines: the data and model sizes, then the accuracy and the time it took."""
    return [
        f"{results['train_images']} training / {results['test_images']} test images, {config.num_patches} patches of "
        f"{config.patch_size}x{config.patch_size} pixels + a class token, {results['parameters']:,} parameters",
        f"test accuracy {results['test_accuracy']:.4f} (train {results['train_accuracy']:.4f}) after "
        f"{config.epochs} epochs in {results['train_seconds']:.1f} s on {device} with {results['threads']} "
        f"thread{'' if results['threads'] == 1 else 's'} "
        f"({results['train_cpu_seconds']:.1f} s of CPU time)",
    ]


def _upsample(patch_weights: list[float], config: ViTDigitsConfig) -> Tensor:
    """Patch weights ``(P,)`` as an 8x8 map (each patch's weight fills its square)."""
    side = IMAGE_SIZE // config.patch_size
    grid = torch.tensor(patch_weights).view(side, side)  # (g, g)
    return grid.repeat_interleave(config.patch_size, 0).repeat_interleave(config.patch_size, 1)  # (8, 8)


def _plot(images: Tensor, results: dict, config: ViTDigitsConfig, path: Path) -> None:
    examples = results["examples"]
    fig = new_figure(1.6 * len(examples) + 0.6, 5.4)
    axes = fig.subplots(3, len(examples), squeeze=False)
    for j, example in enumerate(examples):
        image = images[j].numpy()
        ok = "" if example["prediction"] == example["label"] else " (wrong)"
        axes[0][j].imshow(image, cmap="gray_r")
        axes[0][j].set_title(f"label {example['label']}, says {example['prediction']}{ok}", fontsize=7)
        for row, key in ((1, "cls_attention_last_layer"), (2, "cls_attention_rollout")):
            # the attention map, with the digit's strokes outlined on top
            axes[row][j].imshow(_upsample(example[key], config).numpy(), cmap="magma")
            axes[row][j].contour(image, levels=[0.4], colors="cyan", linewidths=1.0)
        for row in range(3):
            axes[row][j].set_xticks([])
            axes[row][j].set_yticks([])
    axes[0][0].set_ylabel("image", fontsize=8)
    axes[1][0].set_ylabel("[CLS] attention\nlast layer", fontsize=8)
    axes[2][0].set_ylabel("[CLS] attention\nrollout", fontsize=8)
    fig.suptitle(
        f"ViT on 8x8 digits: {config.num_patches} patch tokens, test accuracy {results['test_accuracy']:.3f}",
        fontsize=10,
    )
    save_figure(fig, path)
