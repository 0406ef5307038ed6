"""qkv.runtime.padded_linear pads the rows of bf16 CPU products to few shapes: the results and gradients must be
those of the unpadded product (checked against float64 references and against F.linear), and only
the products that compile in oneDNN are padded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.attention.multihead import MultiHeadAttention
from qkv.nn.loss import fused_linear_cross_entropy, label_smoothed_cross_entropy
from qkv.runtime import padded_linear as shapes
from qkv.runtime.padded_linear import ROW_MULTIPLE, Linear, linear, padded_rows, pads_rows


def test_padded_rows():
    assert [padded_rows(n) for n in (1, ROW_MULTIPLE - 1, ROW_MULTIPLE, ROW_MULTIPLE + 1)] == [
        ROW_MULTIPLE,
        ROW_MULTIPLE,
        ROW_MULTIPLE,
        2 * ROW_MULTIPLE,
    ]


def test_which_products_are_padded():
    x32, x16 = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16)
    assert not pads_rows(x32, 4 * ROW_MULTIPLE)  # float32 on CPU: MKL, nothing compiles
    assert pads_rows(x16, 4 * ROW_MULTIPLE)
    assert not pads_rows(x16, ROW_MULTIPLE - 1)  # small products would be mostly padding
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pads_rows(x32, ROW_MULTIPLE)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not pads_rows(x32, ROW_MULTIPLE)
    assert not pads_rows(torch.zeros(2, 3, dtype=torch.bfloat16, device="meta"), 4 * ROW_MULTIPLE)


def test_padding_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(shapes, "PAD_ROWS", False)
    assert not pads_rows(torch.zeros(2, 3, dtype=torch.bfloat16), 4 * ROW_MULTIPLE)


@pytest.mark.parametrize("shape", [(3, 137, 64), (2, ROW_MULTIPLE, 64), (7, 64)])
def test_linear_matches_the_unpadded_product_and_its_gradients(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    weight = torch.randn(48, 64, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    upstream = torch.randn(*shape[:-1], 48)
    results = []
    for fn in (linear, F.linear):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, weight, bias)
        (out.float() * upstream).sum().backward()
        results.append((out.float(), x.grad.clone(), weight.grad.clone(), bias.grad.clone()))
        x.grad = weight.grad = bias.grad = None
    # the same bf16 products, padded or not
    for padded, plain in zip(*results):
        torch.testing.assert_close(padded, plain, rtol=1e-2, atol=1e-2)
    # and both are the float64 product, to bf16 accuracy
    reference = x.detach().double() @ weight.detach().double().T + bias.detach().double()
    torch.testing.assert_close(results[0][0].double(), reference, rtol=2e-2, atol=0.15)
    torch.testing.assert_close(
        results[0][2].double(),
        upstream.reshape(-1, 48).double().T @ x.detach().reshape(-1, 64).double(),
        rtol=2e-2,
        atol=0.5,
    )
    assert results[0][0].shape == (*shape[:-1], 48)


def test_linear_module_is_nn_linear_with_the_same_state_and_fuses():
    layer = Linear(8, 4)
    assert isinstance(layer, nn.Linear)
    assert set(layer.state_dict()) == set(nn.Linear(8, 4).state_dict())
    attention = MultiHeadAttention(16, 4)
    assert isinstance(attention.q_proj, Linear)
    assert attention._fuses(attention.q_proj, attention.k_proj, attention.v_proj)
    attention.fuse_projections = False  # each projection module called on its own (hooks run)
    assert not attention._fuses(attention.q_proj, attention.k_proj, attention.v_proj)


def test_fused_loss_with_a_padded_last_chunk_matches_the_reference():
    """1,114 real positions (of 1,300): a chunk of 1,024, then 90 padded to 256, the padding masked."""
    torch.manual_seed(0)
    n, d, vocab, pad_id = 1300, 32, 50, 0
    hidden = torch.randn(1, n, d, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, d)).requires_grad_()
    target = torch.randint(1, vocab, (1, n))
    target[0, ::7] = pad_id
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, target, 0.1, pad_id)
    loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    reference = label_smoothed_cross_entropy(h64 @ w64.T, target, 0.1, pad_id)
    reference.backward()
    torch.testing.assert_close(loss.double(), reference.detach().double(), rtol=1e-2, atol=0)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=0.05, atol=0.02)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=0.05, atol=0.5)
