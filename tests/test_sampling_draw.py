"""qkv.models.sampling.draw: inverse transform sampling, checked against numpy's running sums with the
same uniform numbers, and against the probabilities themselves over many draws."""

from __future__ import annotations

import numpy as np
import torch

from qkv.models.sampling import draw


def test_each_index_is_the_first_running_sum_above_the_uniform_number():
    probs = torch.softmax(torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)), dim=-1)
    probs[:, 500:700] = 0  # masked tokens (top-k / top-p)
    drawn = draw(probs, torch.Generator().manual_seed(7))
    u = torch.rand(6, 1, generator=torch.Generator().manual_seed(7)).numpy()
    sums = np.cumsum(probs.numpy().astype(np.float64), axis=-1)
    for row in range(6):
        expected = int(np.searchsorted(sums[row], u[row, 0] * sums[row, -1], side="right"))
        assert abs(int(drawn[row]) - expected) <= 1  # float32 against float64 sums: a tie may move one place
        assert probs[row, int(drawn[row])] > 0


def test_the_draws_follow_the_probabilities_and_skip_zeros():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0]]).repeat(20000, 1)
    drawn = draw(probs, torch.Generator().manual_seed(1))
    counts = torch.bincount(drawn, minlength=5).double() / len(drawn)
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts, probs[0].double(), atol=0.015)  # 20,000 draws: sd <= 0.0036


def test_a_one_hot_row_always_gives_its_token():
    probs = torch.zeros(50, 7)
    probs[:, 6] = 1.0
    assert draw(probs, torch.Generator().manual_seed(2)).tolist() == [6] * 50
