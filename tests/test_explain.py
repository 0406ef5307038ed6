"""qkv explain: the by-hand worked example against torch (independent) and qkv (the library)."""

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.cli import main
from qkv.experiments.explain import format_example, worked_example

SIZES = [
    dict(tokens=4, dim=6, dk=3, heads=2, seed=0),  # the example
    dict(tokens=5, dim=8, dk=4, heads=4, seed=3),
    dict(tokens=1, dim=2, dk=1, heads=1, seed=7),
]


@pytest.mark.parametrize("sizes", SIZES)
def test_matches_library_and_torch(sizes):
    ex = worked_example(**sizes)
    # the library, as computed by the example itself
    assert max(ex.checks.values()) < 1e-6, ex.checks
    # torch's own attention and multi-head attention: references independent of qkv
    ref = F.scaled_dot_product_attention(ex.q[None], ex.k[None], ex.v[None])[0]
    torch.testing.assert_close(ex.z, ref, atol=1e-6, rtol=0)
    hand = torch.softmax(ex.q @ ex.k.T / math.sqrt(sizes["dk"]), dim=-1)
    torch.testing.assert_close(ex.weights, hand, atol=1e-12, rtol=0)
    mha = torch.nn.MultiheadAttention(sizes["dim"], sizes["heads"], bias=False, batch_first=True).double()
    with torch.no_grad():
        w_q = torch.cat([h.w_q for h in ex.heads], 1)  # (d, h * d_h)
        w_k = torch.cat([h.w_k for h in ex.heads], 1)
        w_v = torch.cat([h.w_v for h in ex.heads], 1)
        mha.in_proj_weight.copy_(torch.cat([w_q.T, w_k.T, w_v.T]))
        mha.out_proj.weight.copy_(ex.w_o.T)
    out, weights = mha(ex.x[None], ex.x[None], ex.x[None], average_attn_weights=False)
    torch.testing.assert_close(ex.multi_head, out[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.stack([h.weights for h in ex.heads]), weights[0], atol=1e-6, rtol=0)


def test_conventions_agree_and_normalise():
    ex = worked_example()
    assert ex.x.shape == (4, 6) and ex.w_q.shape == (6, 3) and ex.z.shape == (4, 3)
    torch.testing.assert_close(ex.weights.sum(1), torch.ones(4, dtype=torch.float64))  # rows
    torch.testing.assert_close(ex.weights_cols.sum(0), torch.ones(4, dtype=torch.float64))  # columns
    torch.testing.assert_close(ex.scores_cols, ex.scores.T, atol=1e-12, rtol=0)
    torch.testing.assert_close(ex.z_cols, ex.z.T, atol=1e-12, rtol=0)
    torch.testing.assert_close(ex.scaled, ex.scores / math.sqrt(3))
    # the printed inputs are the exact inputs: X has one decimal, the weights two
    assert torch.equal(ex.x, (ex.x * 10).round() / 10)
    assert torch.equal(ex.w_q, (ex.w_q * 100).round() / 100)


def test_text_shows_every_step():
    ex = worked_example()
    text = format_example(ex)
    for needle in (
        "X  (4 x 6)",
        "W_Q  (6 x 3)",
        "S = Q K^T",
        "S / sqrt(d_k)",
        "A = softmax",
        "Z = A V",
        "K^T Q",
        "Z = V A",
        "Concat(Z^1, ..., Z^h)",
        "W_O  (6 x 6)",
        "MultiHead(X) = Concat W_O",
    ):
        assert needle in text, needle
    assert f"{ex.z[0, 0].item():.3f}" in text and f"{ex.multi_head[3, 5].item():.3f}" in text
    md = format_example(ex, fmt="markdown", decimals=2)
    assert "| **t0** |" in md and "## Multi-head attention" in md
    with pytest.raises(ValueError, match="format"):
        format_example(ex, fmt="html")


def test_cli(capsys, tmp_path):
    assert main(["explain", "--tokens", "3", "--dim", "4", "--dk", "2", "--heads", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 tokens, 4 features, d_k = 2" in out and "qkv.MultiHeadAttention: output" in out
    target = tmp_path / "by-hand.md"
    assert main(["explain", "--format", "markdown", "-o", str(target)]) == 0
    assert target.read_text().startswith("## Scaled dot-product attention by hand")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "4"], "divisible by --heads"),
        (["--tokens", "0"], "--tokens must be positive"),
        (["--tokens", "500"], "prints every number"),
    ],
)
def test_cli_errors(capsys, argv, message):
    assert main(["explain", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv explain: error:") and message in err and len(err.strip().splitlines()) == 1
