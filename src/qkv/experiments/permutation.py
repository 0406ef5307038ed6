"""Self-attention is permutation-equivariant; order has to come from positional encodings.

Without a positional encoding, an encoder (self-attention without a causal mask, position-wise
feed-forward, LayerNorm) treats its input as a set: for any permutation ``P``,
``encoder(P x) = P encoder(x)``, because ``softmax((P Q)(P K)^T) P V = P softmax(Q K^T) V``.
Adding the sinusoidal encoding of section 3.5 breaks that symmetry: the same token at another
position gets another vector. This experiment measures both, and draws the encoding and the
similarity of positions (``PE(p) . PE(q)`` depends on ``p - q`` only, the property the paper
hoped would let the model attend by relative position).

Shape legend: ``b`` batch, ``s`` sequence length, ``d`` d_model, ``L`` positions drawn.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

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
from qkv.models.encoder_model import EncoderModel
from qkv.models.transformer import TransformerConfig
from qkv.nn.positional import sinusoidal_table

NAME = "permutation"
ENCODINGS = ("none", "sinusoidal", "learned")


@dataclass(frozen=True)
class PermutationConfig:
    """Sizes of the permutation experiment."""

    vocab_size: int = 100  # random token ids 1 .. vocab_size - 1 (0 is padding, never used)
    d_model: int = 64  # encoder width
    num_heads: int = 4  # attention heads
    num_layers: int = 2  # encoder layers
    d_ff: int = 128  # feed-forward width
    batch_size: int = 4  # sequences
    seq_len: int = 16  # tokens per sequence
    num_permutations: int = 20  # random permutations tried (the largest error is kept)
    table_positions: int = 100  # positions drawn in the encoding and similarity figures
    table_dim: int = 64  # width of the drawn sinusoidal table

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.num_permutations < 1 or self.vocab_size < 3:
            raise ValueError(
                f"need seq_len >= 2, num_permutations >= 1, vocab_size >= 3; got {self.seq_len}, "
                f"{self.num_permutations}, {self.vocab_size}"
            )


QUICK = PermutationConfig(num_permutations=5)


def build_encoder(config: PermutationConfig, positional: str) -> EncoderModel:
    """A qkv :class:`EncoderModel` without dropout, in eval mode."""
    model_config = TransformerConfig(
        src_vocab_size=config.vocab_size,
        d_model=config.d_model,
        num_heads=config.num_heads,
        num_encoder_layers=config.num_layers,
        d_ff=config.d_ff,
        dropout=0.0,
        positional=positional,
        max_len=max(config.seq_len, 16),
    )
    return EncoderModel(model_config).eval()


@torch.no_grad()
def equivariance_error(model: EncoderModel, ids: Tensor, permutations: list[Tensor]) -> float:
    """``max |model(ids[:, perm]) - model(ids)[:, perm]|`` over the permutations.

    Args:
        ids: ``(b, s)`` token ids without padding.
        permutations: each a permutation of ``range(s)``.
    """
    hidden = model(ids).last_hidden_state  # (b, s, d)
    worst = 0.0
    for perm in permutations:
        permuted = model(ids[:, perm]).last_hidden_state  # (b, s, d)
        worst = max(worst, (permuted - hidden[:, perm]).abs().max().item())
    return worst


def position_similarity(table: Tensor) -> Tensor:
    """Cosine similarity of every pair of position vectors: ``(L, d)`` -> ``(L, L)``."""
    unit = table / table.norm(dim=-1, keepdim=True)
    return unit @ unit.T


def offset_spread(table: Tensor) -> float:
    """How far ``PE(p) . PE(p + k)`` varies with ``p`` for a fixed offset ``k`` (largest over ``k``):
    zero up to rounding for the sinusoidal table, since ``sum_i cos(w_i p) cos(w_i (p+k)) +
    sin(w_i p) sin(w_i (p+k)) = sum_i cos(w_i k)``."""
    dots = table.double() @ table.double().T  # (L, L)
    positions = dots.size(0)
    return max((dots.diagonal(k).max() - dots.diagonal(k).min()).item() for k in range(positions - 1))


def run(
    *,
    out: str | Path,
    quick: bool = False,
    seed: int = 0,
    device: str | None = None,
    config: PermutationConfig | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Measure the equivariance error of encoders with and without positional encodings; write
    ``results.json`` and ``permutation.png`` under ``<out>/permutation``."""
    del progress  # a few forward passes
    config = config or (QUICK if quick else PermutationConfig())
    dev = pick_device(device)
    folder = experiment_dir(out, NAME)
    errors: dict[str, dict[str, float]] = {}
    with Stopwatch() as watch, seeded(seed, dev):
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, config.vocab_size, (config.batch_size, config.seq_len), generator=generator).to(dev)
        permutations = [
            torch.randperm(config.seq_len, generator=generator).to(dev) for _ in range(config.num_permutations)
        ]
        for positional in ENCODINGS:
            model = build_encoder(config, positional).to(dev)
            errors[positional] = {
                "float64": equivariance_error(model.double(), ids, permutations),
                "float32": equivariance_error(model.float(), ids, permutations),
            }
    table = sinusoidal_table(config.table_positions, config.table_dim)  # (L, d)
    results = {
        "errors": errors,
        "seq_len": config.seq_len,
        "offset_spread_sinusoidal": offset_spread(table),
        "similarity_first_rows": position_similarity(table)[:4, :12].tolist(),
    }
    claims = {
        "equivariant to 1e-6 without positional encoding": errors["none"]["float64"] < 1e-6,
        "not equivariant with the sinusoidal encoding": errors["sinusoidal"]["float64"] > 1e-2,
        "not equivariant with a learned encoding": errors["learned"]["float64"] > 1e-3,
    }
    summary = (
        [
            f"max |enc(P x) - P enc(x)| over {config.num_permutations} permutations of {config.seq_len} tokens "
            f"({config.num_layers} layers, d_model {config.d_model}):"
        ]
        + [
            f"  {positional:>10}: float64 {e['float64']:.2e}, float32 {e['float32']:.2e}"
            for positional, e in errors.items()
        ]
        + [
            f"sinusoidal PE(p).PE(p+k) varies with p by at most {results['offset_spread_sinusoidal']:.1e} "
            "(depends on the offset k only)"
        ]
    )
    fig_name = "permutation.png"
    _plot(results, table, folder / fig_name)
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


def _plot(results: dict, table: Tensor, path: Path) -> None:
    fig = new_figure(14, 4.4)
    ax_table, ax_sim, ax_err = fig.subplots(1, 3)
    image = ax_table.imshow(table.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    ax_table.set_xlabel("dimension i (even: sin, odd: cos)")
    ax_table.set_ylabel("position p")
    ax_table.set_title("sinusoidal encoding PE(p, i)", fontsize=10)
    fig.colorbar(image, ax=ax_table)
    image = ax_sim.imshow(position_similarity(table).numpy(), cmap="viridis")
    ax_sim.set_xlabel("position q")
    ax_sim.set_ylabel("position p")
    ax_sim.set_title("cosine similarity of PE(p) and PE(q)", fontsize=10)
    fig.colorbar(image, ax=ax_sim)
    names = list(results["errors"])
    tiny = 1e-18  # a bar for an exact zero on the log axis
    for offset, precision in ((-0.2, "float64"), (0.2, "float32")):
        values = [max(results["errors"][n][precision], tiny) for n in names]
        ax_err.bar([i + offset for i in range(len(names))], values, width=0.4, label=precision)
    ax_err.set_yscale("log")
    ax_err.set_xticks(range(len(names)))
    ax_err.set_xticklabels([f"PE: {n}" for n in names])
    ax_err.axhline(1e-6, color="gray", ls=":", label="1e-6")
    ax_err.set_ylabel("max |enc(P x) - P enc(x)|")
    ax_err.set_title(
        "permuting the input permutes the output\nonly without positional encoding\n(float32 residue = rounding)",
        fontsize=10,
    )
    ax_err.legend(fontsize=8)
    save_figure(fig, path)
