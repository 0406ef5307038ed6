"""Mask helpers and positional encodings against hand-built references."""

import math

import pytest
import torch

import qkv
from qkv.attention import as_additive


def test_causal_mask_matches_definition():
    for s_q, s_k in [(4, 4), (2, 5), (5, 2), (1, 3), (0, 3)]:
        expected = torch.tensor([[j <= i + s_k - s_q for j in range(s_k)] for i in range(s_q)], dtype=torch.bool)
        assert torch.equal(qkv.causal_mask(s_q, s_k), expected.reshape(s_q, s_k))
    assert torch.equal(qkv.causal_mask(3), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_padding_masks():
    expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(qkv.padding_mask_from_lengths([3, 1, 4]), expected)
    assert qkv.padding_mask_from_lengths(torch.tensor([1, 2]), max_len=5).shape == (2, 5)
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 3, 4]])
    assert torch.equal(qkv.padding_mask_from_ids(ids, pad_id=0), expected)
    with pytest.raises(ValueError, match="exceeds max_len"):
        qkv.padding_mask_from_lengths([3, 6], max_len=4)
    with pytest.raises(ValueError, match="non-negative"):
        qkv.padding_mask_from_lengths([3, -1])


def test_combine_masks():
    a = torch.tensor([[True, False, True]])
    b = torch.tensor([[True], [False]])
    assert torch.equal(qkv.combine_masks(a, None, b), a & b)
    assert qkv.combine_masks(None, None) is None
    f = torch.tensor([[0.5, 1.0, -2.0]])
    combined = qkv.combine_masks(a, f)
    assert combined.dtype == torch.float32
    torch.testing.assert_close(combined, torch.tensor([[0.5, float("-inf"), -2.0]]))
    assert torch.equal(as_additive(a), torch.tensor([[0.0, float("-inf"), 0.0]]))
    with pytest.raises(ValueError, match="do not broadcast"):
        qkv.combine_masks(torch.ones(2, 3, dtype=torch.bool), torch.ones(4, dtype=torch.bool))


def test_sinusoidal_table_is_the_papers_formula():
    max_len, d = 50, 16
    table = qkv.sinusoidal_table(max_len, d)
    for pos in range(max_len):
        for i in range(d // 2):
            angle = pos / (10000 ** (2 * i / d))
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("cls", [qkv.SinusoidalPositionalEncoding, qkv.LearnedPositionalEncoding])
def test_positional_encoding_offsets_and_length_limit(cls):
    pe = cls(8, max_len=10)
    x = torch.zeros(2, 6, 8)
    full = pe(x)
    torch.testing.assert_close(pe(x[:, 2:4], start=2), full[:, 2:4])
    with pytest.raises(ValueError, match="exceed the positional table of max_len=10"):
        pe(torch.zeros(1, 11, 8))
    with pytest.raises(ValueError, match="exceed"):
        pe(torch.zeros(1, 3, 8), start=8)
    with pytest.raises(ValueError, match=r"\(batch, seq, d_model\)"):
        pe(torch.zeros(6, 8))
