"""The long-range task, its three models and their training (run by :mod:`qkv.experiments.long_range`).

The task: the first token is one of ``K`` symbols, then come ``N`` noise tokens, then a query
token; the answer is the first symbol. A vanilla tanh RNN, an LSTM and a one-layer attention
model, with matched parameter counts, are trained on fresh batches for each ``N``.

Shape legend: ``b`` batch, ``T`` sequence length (``N + 2``), ``e`` embedding size, ``h`` hidden
size, ``d`` d_model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.experiments.common import Stopwatch
from qkv.nn.layers import EncoderLayer
from qkv.nn.positional import sinusoidal_table


@dataclass(frozen=True)
class LongRangeConfig:
    """Sizes of the long-range experiment."""

    distances: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)  # N: noise tokens between symbol and query
    num_symbols: int = 8  # K: classes (chance accuracy is 1/K)
    num_noise: int = 8  # distinct noise tokens
    embed_dim: int = 32  # token embedding size of the recurrent models
    d_model: int = 32  # width of the attention model
    num_heads: int = 4  # attention heads
    d_ff: int = 64  # feed-forward width of the attention model
    batch_size: int = 64  # sequences per training step
    max_steps: int = 800  # training steps at most, per model and distance
    eval_every: int = 50  # validate every this many steps; stop once target_accuracy is reached
    target_accuracy: float = 0.99  # early stopping threshold on the validation set
    lr: float = 3e-3  # Adam learning rate (all models)
    grad_clip: float = 1.0  # gradient norm clipping (all models)
    eval_size: int = 1000  # fresh test sequences per distance
    jacobian_batch: int = 16  # sequences averaged over for the gradient norms

    def __post_init__(self) -> None:
        if not self.distances or min(self.distances) < 1:
            raise ValueError(f"distances must be positive integers, got {self.distances}")
        if self.num_symbols < 2 or self.num_noise < 1:
            raise ValueError(f"need num_symbols >= 2 and num_noise >= 1, got {self.num_symbols}, {self.num_noise}")
        if self.max_steps < 1 or self.eval_every < 1:
            raise ValueError(f"max_steps and eval_every must be positive, got {self.max_steps}, {self.eval_every}")

    @property
    def vocab_size(self) -> int:
        """Symbols, noise tokens and the query token."""
        return self.num_symbols + self.num_noise + 1  # symbols, noise, query

    @property
    def query_id(self) -> int:
        """The id of the query token (after the symbols and the noise)."""
        return self.num_symbols + self.num_noise


QUICK = LongRangeConfig(distances=(8, 16, 64), max_steps=300, eval_size=500, jacobian_batch=8)


def make_batch(config: LongRangeConfig, size: int, distance: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``size`` sequences ``[symbol, noise x distance, query]`` and their answers.

    Returns:
        ``tokens (size, distance + 2)`` int64 and ``targets (size,)``, the first symbol.
    """
    k = config.num_symbols
    tokens = torch.randint(k, k + config.num_noise, (size, distance + 2), generator=generator)
    tokens[:, 0] = torch.randint(0, k, (size,), generator=generator)
    tokens[:, -1] = config.query_id
    return tokens, tokens[:, 0].clone()


class RecurrentClassifier(nn.Module):
    """Embedding, a one-layer ``nn.RNN`` (tanh) or ``nn.LSTM``, a linear readout of the last state.

    Args:
        kind: ``"rnn"`` or ``"lstm"``.
        vocab_size, embed_dim, hidden_size, num_classes: sizes.
    """

    def __init__(self, *, kind: str, vocab_size: int, embed_dim: int, hidden_size: int, num_classes: int) -> None:
        super().__init__()
        if kind not in ("rnn", "lstm"):
            raise ValueError(f"kind must be 'rnn' or 'lstm', got {kind!r}")
        self.kind = kind
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.rnn: nn.RNN | nn.LSTM
        if kind == "rnn":
            self.rnn = nn.RNN(embed_dim, hidden_size, nonlinearity="tanh", batch_first=True)
        else:
            self.rnn = nn.LSTM(embed_dim, hidden_size, batch_first=True)
            with torch.no_grad():  # forget-gate bias 1 (Jozefowicz et al., 2015): the LSTM's best chance
                self.rnn.get_parameter("bias_ih_l0")[hidden_size : 2 * hidden_size].fill_(1.0)
                self.rnn.get_parameter("bias_hh_l0")[hidden_size : 2 * hidden_size].fill_(0.0)
        self.head = nn.Linear(hidden_size, num_classes)

    def embed(self, tokens: Tensor) -> Tensor:
        """Embedded inputs ``(b, T, e)`` for ``tokens (b, T)``."""
        return self.embedding(tokens)  # (b, T, e)

    def features(self, x: Tensor) -> Tensor:
        """The last hidden state ``(b, h)`` for embedded inputs ``x (b, T, e)``."""
        out, _ = self.rnn(x)  # (b, T, h)
        return out[:, -1]

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(b, K)`` for ``tokens (b, T)``."""
        return self.head(self.features(self.embed(tokens)))  # (b, K)


class AttentionClassifier(nn.Module):
    """Embedding plus sinusoidal positions, one qkv :class:`EncoderLayer` (post-LN, no dropout),
    a linear readout at the query (last) position.

    Only the last position is read, so only its row of the layer is computed (:meth:`features`):
    the same numbers as ``layer(x).output[:, -1]`` at O(T d) instead of O(T^2 d) cost.
    """

    positions: Tensor  # (max_len, d) sinusoidal table, a buffer

    def __init__(
        self, *, vocab_size: int, d_model: int, num_heads: int, d_ff: int, num_classes: int, max_len: int
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.register_buffer("positions", sinusoidal_table(max_len, d_model), persistent=False)
        self.layer = EncoderLayer(d_model=d_model, num_heads=num_heads, d_ff=d_ff, dropout=0.0)
        self.head = nn.Linear(d_model, num_classes)

    def embed(self, tokens: Tensor) -> Tensor:
        """Embedded inputs with positions ``(b, T, d)`` for ``tokens (b, T)``."""
        if tokens.size(1) > self.positions.size(0):
            raise ValueError(f"sequence length {tokens.size(1)} exceeds max_len {self.positions.size(0)}")
        return self.embedding(tokens) + self.positions[: tokens.size(1)]  # (b, T, d)

    def features(self, x: Tensor) -> Tensor:
        """The encoder layer's output at the last position, ``(b, d)``, for inputs ``x (b, T, d)``."""
        layer = self.layer
        query = x[:, -1:]  # (b, 1, d)
        attended = layer.self_attn(query, x, x).output  # (b, 1, d): the query row of self-attention
        z = layer.norm1(query + attended)  # post-LN residual, as in EncoderLayer
        z = layer.norm2(z + layer.feed_forward(z))
        return z[:, -1]

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(b, K)`` for ``tokens (b, T)``."""
        return self.head(self.features(self.embed(tokens)))  # (b, K)


# the experiment's models: tokens -> logits, with embed() and features() for the gradient measurements
Classifier: TypeAlias = RecurrentClassifier | AttentionClassifier


def count_parameters(model: nn.Module) -> int:
    """The number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def recurrent_parameters(kind: str, *, vocab_size: int, embed_dim: int, hidden_size: int, num_classes: int) -> int:
    """Parameters of :class:`RecurrentClassifier` (embedding, recurrence with two biases, readout)."""
    gates = 1 if kind == "rnn" else 4
    e, h = embed_dim, hidden_size
    return vocab_size * e + gates * (e * h + h * h + 2 * h) + h * num_classes + num_classes


def matched_hidden_size(kind: str, target: int, *, vocab_size: int, embed_dim: int, num_classes: int) -> int:
    """The hidden size whose parameter count is closest to ``target``."""
    return min(
        range(1, 1025),
        key=lambda h: abs(
            recurrent_parameters(
                kind, vocab_size=vocab_size, embed_dim=embed_dim, hidden_size=h, num_classes=num_classes
            )
            - target
        ),
    )


def build_models(config: LongRangeConfig, max_len: int) -> dict[str, Classifier]:
    """The three models, the recurrent ones sized to the attention model's parameter count."""
    attention = AttentionClassifier(
        vocab_size=config.vocab_size,
        d_model=config.d_model,
        num_heads=config.num_heads,
        d_ff=config.d_ff,
        num_classes=config.num_symbols,
        max_len=max_len,
    )
    target = count_parameters(attention)
    models: dict[str, Classifier] = {}
    for kind in ("rnn", "lstm"):
        hidden = matched_hidden_size(
            kind, target, vocab_size=config.vocab_size, embed_dim=config.embed_dim, num_classes=config.num_symbols
        )
        models[kind] = RecurrentClassifier(
            kind=kind,
            vocab_size=config.vocab_size,
            embed_dim=config.embed_dim,
            hidden_size=hidden,
            num_classes=config.num_symbols,
        )
    models["attention"] = attention
    return models


@torch.no_grad()
def accuracy(model: nn.Module, tokens: Tensor, targets: Tensor, batch_size: int = 250) -> float:
    """The fraction of ``tokens`` whose predicted class is the target, in batches of ``batch_size``."""
    model.eval()
    correct = 0
    for start in range(0, tokens.size(0), batch_size):
        logits = model(tokens[start : start + batch_size])
        correct += int((logits.argmax(-1) == targets[start : start + batch_size]).sum())
    model.train()
    return correct / tokens.size(0)


def train_model(
    model: nn.Module, config: LongRangeConfig, distance: int, generator: torch.Generator, device: torch.device
) -> dict:
    """Adam with gradient clipping on fresh batches until the validation accuracy reaches
    ``target_accuracy`` or ``max_steps`` run out.

    Returns:
        ``{"steps", "curve": [[step, validation accuracy], ...], "seconds"}``.
    """
    model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    val_tokens, val_targets = (t.to(device) for t in make_batch(config, 500, distance, generator))
    curve = []
    step = 0
    with Stopwatch() as watch:
        while True:
            if step % config.eval_every == 0 or step == config.max_steps:
                val = accuracy(model, val_tokens, val_targets)
                curve.append([step, val])
                if val >= config.target_accuracy or step == config.max_steps:
                    break
            tokens, targets = (t.to(device) for t in make_batch(config, config.batch_size, distance, generator))
            loss = F.cross_entropy(model(tokens), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            step += 1
    return {"steps": step, "curve": curve, "seconds": watch.seconds}
