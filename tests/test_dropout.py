"""qkv's CPU dropout: Bernoulli(1 - p) keep mask, mean kept, gradient through the same mask."""

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.nn.dropout import Dropout, dropout, dropout_off


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_keep_rate_and_scale(p):
    torch.manual_seed(0)
    x = torch.ones(1_000_003)  # not a multiple of 4: the last draw word is partly used
    out = dropout(x, p)
    kept = out != 0
    n = x.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma
    p_eff = round(p * 65536) / 65536
    assert abs(p_eff - p) <= 2**-17
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p_eff)))
    # each of the four 16-bit lanes of a 64-bit draw is its own uniform
    lanes = kept[: n - n % 4].view(-1, 4).float().mean(0)
    assert (lanes - (1 - p)).abs().max().item() < 5 * math.sqrt(p * (1 - p) / (n // 4))
    # neighbours are independent: P(both kept) = (1 - p)^2
    both = (kept[:-1] & kept[1:]).float().mean().item()
    assert abs(both - (1 - p) ** 2) < 5 * math.sqrt((1 - p) ** 2 * (1 - (1 - p) ** 2) / n)


def test_mean_matches_torch_dropout():
    torch.manual_seed(1)
    x = torch.randn(400, 500)
    ours = torch.stack([dropout(x, 0.2) for _ in range(20)]).mean(0)
    theirs = torch.stack([F.dropout(x, 0.2) for _ in range(20)]).mean(0)
    # both are unbiased: the average over calls approaches x at the same rate
    assert abs((ours - x).pow(2).mean().item() - (theirs - x).pow(2).mean().item()) < 0.01


def test_gradient_uses_the_forward_mask():
    torch.manual_seed(2)
    x = torch.randn(37, 19, requires_grad=True)
    out = dropout(x, 0.25)
    grad = torch.randn_like(out)
    out.backward(grad)
    mask = out.detach() / x.detach()  # 0 or 1 / (1 - p')
    torch.testing.assert_close(x.grad, grad * mask)


def test_identity_cases_seeding_and_dtypes():
    x = torch.randn(8, 9)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    assert (dropout(x, 1.0) == 0).all()
    torch.manual_seed(3)
    a = dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(a, dropout(x, 0.3))
    assert not torch.equal(a, dropout(x, 0.3))  # a fresh mask each call
    half = dropout(x.bfloat16(), 0.3)
    assert half.dtype == torch.bfloat16 and half.shape == x.shape
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dropout(x, 1.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Dropout(-0.1)


def test_module_follows_train_and_eval():
    layer = Dropout(0.5)
    x = torch.ones(1000)
    assert (layer(x) == 0).any()
    layer.eval()
    assert torch.equal(layer(x), x)
    assert "p=0.5" in repr(layer)


def test_dropout_off_zeroes_every_rate_and_puts_them_back():
    from qkv.attention.multihead import MultiHeadAttention

    model = torch.nn.Sequential(Dropout(0.3), torch.nn.Dropout(0.2), MultiHeadAttention(16, 2, dropout=0.1))
    x = torch.randn(2, 5, 16)
    model.train()
    with dropout_off(model):
        assert [model[0].p, model[1].p, model[2].dropout] == [0.0, 0.0, 0.0]
        assert torch.equal(model[1](model[0](x)), x)
    assert [model[0].p, model[1].p, model[2].dropout] == [0.3, 0.2, 0.1]
    with pytest.raises(RuntimeError), dropout_off(model):
        raise RuntimeError("a failed step")
    assert [model[0].p, model[1].p, model[2].dropout] == [0.3, 0.2, 0.1]
